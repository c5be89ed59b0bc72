"""GPU run: Qwen3-1.7B teacher -> Qwen3-0.6B student on a JSONL of chat prompts.

Give the local HF folders and prompts on the command line (nothing is downloaded):
  opdjax train --config configs/qwen3_1p7b_to_0p6b.py --out runs/q3 \
    --config.teacher.path=/models/Qwen3-1.7B --config.student.path=/models/Qwen3-0.6B \
    --config.task.path=prompts.jsonl
"""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.task.name = "prompts"
  c.task.chat_template = True
  c.task.num_eval = 64
  c.model.dtype = "bfloat16"  # matmuls in bf16; params fp32; logits, log-probs and KL fp32
  c.model.remat_policy = "full"  # rematerialise each layer in backward (memory for 1k-token sequences)
  c.rollout.batch_size = 64
  c.rollout.max_new_tokens = 512
  c.rollout.max_len = 1024
  c.rollout.top_p = 1.0
  c.loss.kind = "sampled_rkl"  # the standard OPD estimator; full_rkl / topk_rkl also work at 152k vocab
  c.loss.chunk = 128
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.total_steps = 500
  c.optim.weight_decay = 0.0
  c.train.steps = 500
  c.train.eval_every = 25
  return c
