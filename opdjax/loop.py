"""The OPD loop: rollouts from the engine -> re-score -> train step -> held-out eval.

`run(cfg, out_dir)` is what `opdjax train` and `opdjax demo` call.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from opdjax.demo import cached_sft_model
from opdjax.loss import LossConfig
from opdjax.models import Model, ModelConfig, load_hf_params, save_hf_params
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.scoring import batch_from_rollout
from opdjax.tasks.addition import EOS, PAD, AdditionTask
from opdjax.train import OptimConfig, TrainState, make_optimizer, make_train_step, opd_loss


def _load_model(role: str, mc: ml_collections.ConfigDict, task: AdditionTask, seed: int):
  if mc.path:
    cfg = ModelConfig.from_pretrained(mc.path)
    if cfg.vocab_size != task.tokenizer.vocab_size:
      raise ValueError(
          f"{role}.path={mc.path} has vocab_size={cfg.vocab_size}, but the addition task uses its own"
          f" {task.tokenizer.vocab_size}-token character vocabulary; leave {role}.path empty to use the"
          " demo models, or pass a folder exported from them.")
    return Model(cfg), load_hf_params(mc.path, cfg)
  model, params, _ = cached_sft_model(role, mc, task, seed)
  return model, params


def _open_metrics(out_dir: str):
  path = os.path.join(out_dir, "metrics.jsonl")
  if os.path.exists(path):
    raise FileExistsError(f"{path} already exists; pass a new --out folder (nothing was overwritten).")
  os.makedirs(out_dir, exist_ok=True)
  return open(path, "w")


def run(cfg: ml_collections.ConfigDict, out_dir: str, progress: bool = True) -> list[dict]:
  if cfg.task.name != "addition":
    raise ValueError(f"task.name={cfg.task.name!r}: the only built-in task is 'addition'.")
  if cfg.rollout.engine != "jax":
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: available engines: 'jax'.")
  loss_cfg = LossConfig(**cfg.loss)
  optim_cfg = OptimConfig(**cfg.optim)
  sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
  task = AdditionTask(cfg.task.max_digits)
  metrics_file = _open_metrics(out_dir)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=2)

  teacher, teacher_params = _load_model("teacher", cfg.teacher, task, cfg.seed)
  student, student_params = _load_model("student", cfg.student, task, cfg.seed)
  optimizer = make_optimizer(optim_cfg)
  step_fn = make_train_step(student, teacher, loss_cfg, optimizer)
  eval_fn = jax.jit(functools.partial(opd_loss, student=student, teacher=teacher,
                                      loss_cfg=LossConfig(kind="full_rkl", chunk=loss_cfg.chunk)))
  state = TrainState.create(student_params, optimizer)
  engine = JaxEngine(student, state.params, max_len=cfg.rollout.max_len, pad_id=PAD, eos_ids=(EOS,))
  eval_engine = JaxEngine(student, state.params, max_len=cfg.rollout.max_len, pad_id=PAD, eos_ids=(EOS,))
  eval_pairs = task.eval_pairs(cfg.task.num_eval)
  eval_prompts = task.prompts(eval_pairs)
  greedy = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
  rng = np.random.default_rng(cfg.seed)

  def evaluate(params, version):
    eval_engine.set_params(params, version)
    r = eval_engine.generate(eval_prompts, sampling, seed=cfg.seed + 7)
    _, m = eval_fn(params, teacher_params, batch_from_rollout(r))
    g = eval_engine.generate(eval_prompts, greedy, seed=0)
    return {"reverse_kl": float(m["reverse_kl"]), "accuracy": task.accuracy(eval_pairs, g.completions())}

  last_eval = evaluate(state.params, 0)
  records = [{"step": 0, **last_eval}]
  metrics_file.write(json.dumps(records[0]) + "\n")
  bar = tqdm(range(cfg.train.steps), desc="OPD", unit="step", disable=not progress)
  bar.set_postfix(acc=f"{last_eval['accuracy']:.3f}", rkl=f"{last_eval['reverse_kl']:.4f}")
  t0 = time.time()
  for step in bar:
    pairs = task.sample_pairs(rng, cfg.rollout.batch_size)
    engine.set_params(state.params, step)  # on-policy: the engine samples with the current params
    rollout = engine.generate(task.prompts(pairs), sampling, seed=cfg.seed * 1_000_003 + step)
    train_acc = task.accuracy(pairs, rollout.completions())
    state, m = step_fn(state, teacher_params, batch_from_rollout(rollout))
    rec = {"step": step + 1, "params_version": rollout.params_version, "train_accuracy": train_acc}
    rec.update({k if k != "reverse_kl" else "train_reverse_kl": float(v) for k, v in m.items()})
    if (step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps:
      last_eval = evaluate(state.params, step + 1)
      bar.set_postfix(acc=f"{last_eval['accuracy']:.3f}", rkl=f"{last_eval['reverse_kl']:.4f}")
    rec.update(last_eval)  # held-out numbers from the latest evaluation
    rec["elapsed_s"] = round(time.time() - t0, 3)
    metrics_file.write(json.dumps(rec) + "\n")
    metrics_file.flush()
    records.append(rec)
  metrics_file.close()
  save_hf_params(state.params, student.cfg, os.path.join(out_dir, "student"))
  return records
