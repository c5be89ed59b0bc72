"""A run's student out of its checkpoint: restored as (model, params, meta), or exported as an HF folder.

`run_dir` is a run folder (OUT), its checkpoints/ folder, or checkpoints/best (the best step's own copy,
verified on its own: a corrupt best/ is refused, whatever latest/ holds).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from opdjax.errors import UserError
from opdjax.pipeline.checkpoint import BEST_FILE, RunCheckpointer


def restore_student(run_dir: str, step: int | None = None):
  """(model, params, meta) of the student in a run's checkpoint (the latest when `step` is None)."""
  from opdjax.models import Model, ModelConfig
  from opdjax.training.step import OptimConfig, TrainState, make_optimizer

  if os.path.exists(os.path.join(run_dir, BEST_FILE)):  # checkpoints/best: its own copy, read on its own
    ckpt = RunCheckpointer(os.path.dirname(os.path.abspath(run_dir)), steps_in=os.path.basename(run_dir.rstrip("/")))
    ckpt_dir = run_dir
  else:
    ckpt_dir = run_dir if os.path.isdir(os.path.join(run_dir, "latest")) else os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(os.path.join(ckpt_dir, "latest")):
      raise UserError(f"{run_dir} holds no opdjax checkpoints (expected {ckpt_dir}/latest/<step>).")
    ckpt = RunCheckpointer(ckpt_dir)
  step = ckpt.latest_step() if step is None else step
  if step is None or step not in ckpt.all_steps():
    raise UserError(f"no complete checkpoint {'' if step is None else f'step {step} '}in {ckpt_dir};"
                    f" complete steps: {ckpt.all_steps()}.")
  meta = ckpt.read_meta(step)
  model = Model(ModelConfig.from_hf_dict(meta["student_config"]))
  optimizer = make_optimizer(OptimConfig(**meta["config"]["optim"]))
  state = jax.eval_shape(lambda: TrainState.create(model.init(jax.random.key(0)), optimizer))
  try:
    run = ckpt.restore_run(step, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state))
  finally:
    ckpt.close()
  return model, run.train.params, run.meta()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def export(run_dir: str, out_dir: str, step: int | None = None) -> int:
  """Writes the checkpoint's student as an HF safetensors folder, with the tokenizer files the run
  used: from the run's own student/ folder (train writes them there), else the model folder of its
  config (only when it is still on disk: nothing is fetched again). Returns the step exported."""
  from opdjax.models import save_hf_params
  from opdjax.models.fetch import model_dir

  model, params, meta = restore_student(run_dir, step)
  step = meta["step"]
  run_root = run_dir.rstrip("/")
  while run_root and not os.path.isdir(os.path.join(run_root, "checkpoints")) and os.path.dirname(run_root) != run_root:
    run_root = os.path.dirname(run_root)  # OUT, from OUT/checkpoints or OUT/checkpoints/best
  sources = [os.path.join(run_root, "student")]
  src = meta["config"].get("student", {}).get("path") or meta["config"].get("teacher", {}).get("path")
  if src and not src.startswith("fetch:"):
    sources.append(src)
  elif src:  # fetch:NAME: only a folder already in this cache; nothing is downloaded again
    sources.append(model_dir(src[len("fetch:"):]))
  extra = {}
  for name in TOKENIZER_FILES:
    for folder in sources:
      if os.path.exists(os.path.join(folder, name)):
        with open(os.path.join(folder, name)) as f:
          extra[name] = f.read()
        break
  save_hf_params(params, model.cfg, out_dir, extra_files=extra)
  return step
