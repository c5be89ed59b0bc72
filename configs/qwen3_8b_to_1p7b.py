"""GPU cluster run: Qwen3-8B teacher -> Qwen3-1.7B student on a JSONL of chat prompts, the README's 2 x 8 GPU
worked example ("Running on a cluster"): on each node GPUs 0-5 train (one process a node, mesh data=2 x
fsdp=6) and GPUs 6-7 run a vLLM sidecar each; with the flags below the sidecars serve the student with its
FP8 recipe and process 0 samples one step ahead (async_depth=1, bounded), the guard warning against a budget.

240 rows a step and 144 held-out prompts: both split over that layout's 12 trainer GPUs, and over the 8 or
16 of launch/slurm_multinode.sh's other layouts on 2 x 8 GPUs (VLLM_NODES=1; no sidecars).

Give the local HF folders, prompts, recipe and budget on the command line (nothing is downloaded):
  NODES="node0 node1" VLLM_GPUS_PER_NODE=2 launch/slurm_multinode.sh --dry-run \\
    configs/qwen3_8b_to_1p7b.py runs/q3-8b-to-1p7b \\
    --config.teacher.path=/models/Qwen3-8B --config.student.path=/models/Qwen3-1.7B \\
    --config.task.path=/data/prompts.jsonl --config.rollout.vllm.recipe=/runs/sens-1p7b/recipe.json \\
    --config.rollout.async_depth=1 --config.rollout.async_mode=bounded \\
    --config.train.budget=/runs/calib/budget.json --config.train.guard=warn
Check the trainer's memory first: opdjax plan --teacher qwen3-8b --student qwen3-1.7b --devices 12 \\
    --mesh data=2,fsdp=6 --batch 240 --seq-len 1024 --prompt-len 512 --loss sampled_rkl --hbm-gib 80
"""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.task.name = "prompts"
  c.task.chat_template = True
  c.task.num_eval = 144  # 144 and 240 split over 8, 12 and 16 trainer devices
  c.model.dtype = "bfloat16"  # matmuls in bf16; params fp32; logits, log-probs and KL fp32
  c.model.remat_policy = "full"  # rematerialise each layer in backward (memory for 1k-token sequences)
  c.rollout.batch_size = 240
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
