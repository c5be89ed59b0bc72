"""GPU cluster run: Qwen3-8B teacher -> Qwen3-1.7B student on a JSONL of chat prompts (the README's
2 x 8 GPU worked example: one node trains with mesh.fsdp=8, the other runs vLLM sidecars).

Give the local HF folders and prompts on the command line (nothing is downloaded):
  launch/slurm_multinode.sh --dry-run configs/qwen3_8b_to_1p7b.py runs/q3-8b-to-1p7b \\
    --config.teacher.path=/models/Qwen3-8B --config.student.path=/models/Qwen3-1.7B \\
    --config.task.path=/data/prompts.jsonl
Check memory first: opdjax plan --teacher qwen3-8b --student qwen3-1.7b --devices 8 --mesh fsdp=8 --hbm-gib 80
"""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.task.name = "prompts"
  c.task.chat_template = True
  c.task.num_eval = 128
  c.model.dtype = "bfloat16"  # matmuls in bf16; params fp32; logits, log-probs and KL fp32
  c.model.remat_policy = "full"  # rematerialise each layer in backward (memory for 1k-token sequences)
  c.rollout.batch_size = 256
  c.rollout.max_new_tokens = 512
  c.rollout.max_len = 1024
  c.rollout.vllm.dtype = "bfloat16"
  c.rollout.vllm.enforce_eager = False  # CUDA graphs on the sidecars' GPUs
  c.loss.kind = "sampled_rkl"
  c.loss.chunk = 128
  c.optim.learning_rate = 1e-6
  c.optim.warmup_steps = 10
  c.optim.total_steps = 500
  c.train.steps = 500
  c.train.eval_every = 25
  return c
