"""The OPD loop: rollouts from the engine -> re-score -> train step -> held-out eval.

`run(cfg, out_dir)` is what `opdjax train` and `opdjax demo` call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from opdjax.errors import UserError
from opdjax.models import Model, save_hf_params
from opdjax.pipeline.build import load_model, make_task
from opdjax.pipeline.checkpoint import RunCheckpointer, package_versions
from opdjax.pipeline.heldout import HeldOut
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.scoring.mismatch import exact_kl
from opdjax.scoring.rescore import batch_from_rollout, masked_mean
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig, TrainState, make_optimizer, make_train_step
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView


def _fault(phase: str, step: int) -> None:
  """Fault injection for the resume tests: OPDJAX_FAULT=phase@step SIGKILLs this process there."""
  if os.environ.get("OPDJAX_FAULT") == f"{phase}@{step}":
    os.kill(os.getpid(), signal.SIGKILL)


def _truncate_metrics(path: str, last_step: int) -> list[dict]:
  """Keeps the records of steps <= last_step (atomically), so every step is logged exactly once."""
  records = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the crash
          break
        if rec["step"] > last_step:
          break
        records.append(rec)
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  os.replace(path + ".tmp", path)
  return records


def run(cfg: ml_collections.ConfigDict, out_dir: str, progress: bool = True, resume: str = "auto",
        fallback: bool = False) -> list[dict]:
  """OPD for `cfg.train.steps` steps into `out_dir`, resuming from its latest checkpoint if any.

  `resume`: "auto" (resume when out_dir has a checkpoint), "require" (error if it has none) or
  "never". `fallback`: when the latest checkpoint cannot be restored, use the previous good one.
  """
  if cfg.rollout.engine not in ("jax", "vllm"):
    raise UserError(f"rollout.engine={cfg.rollout.engine!r}: choose 'jax' or 'vllm'.")
  if cfg.train.on_nonfinite not in ("halt", "skip"):
    raise UserError(f"train.on_nonfinite={cfg.train.on_nonfinite!r}; choose 'halt' or 'skip'.")
  loss_cfg = LossConfig(**cfg.loss)
  optim_cfg = OptimConfig(**cfg.optim)
  sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
  metrics_path = os.path.join(out_dir, "metrics.jsonl")
  ckpt_dir = os.path.join(out_dir, "checkpoints")
  # A run of ours that died before its first checkpoint completed starts over; anyone else's
  # metrics.jsonl is never touched.
  ours = os.path.isdir(ckpt_dir)
  ckpt = RunCheckpointer(ckpt_dir, keep=cfg.train.keep_checkpoints, best_metric=cfg.train.best_metric)
  resuming = resume != "never" and ckpt.latest_step() is not None
  if resume == "require" and not resuming:
    raise UserError(f"--resume: no checkpoint under {ckpt_dir}.")
  if not resuming and not ours and os.path.exists(metrics_path):
    raise FileExistsError(f"{metrics_path} exists but {ckpt_dir} has no checkpoint to resume from; pass a new"
                          " --out folder (nothing was overwritten).")
  task = make_task(cfg)
  teacher, teacher_params = load_model("teacher", cfg, task)
  student, student_params = load_model("student", cfg, task)
  teacher_view = EngineView.parse(cfg.teacher.view)
  if teacher_view.lag:
    raise UserError("teacher.view cannot have a lag: the teacher never changes.")
  clean_teacher, clean_teacher_params = teacher, teacher_params
  if teacher_view != EngineView():
    teacher = teacher_view.model(teacher)
    teacher_params = jax.jit(lambda p: teacher_view.transform(p, teacher.cfg.num_layers))(teacher_params)
    teacher_kl = jax.jit(lambda qp, cp, b: masked_mean(
        exact_kl(teacher, qp, clean_teacher, cp, b), b["loss_mask"]))
  optimizer = make_optimizer(optim_cfg)
  step_fn = make_train_step(student, teacher, loss_cfg, optimizer,  # checks the vocabularies match
                            skip_nonfinite=cfg.train.on_nonfinite == "skip")

  state = TrainState.create(student_params, optimizer)
  view = EngineView.parse(cfg.rollout.view)
  history = ParamsHistory(view.lag + 1) if view.lag else None
  start, last_eval = 0, None
  if resuming:
    start, state, last_eval = _resume(ckpt, state, history, student, fallback)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=2)

  engine_kw = {"max_len": cfg.rollout.max_len, "pad_id": task.pad_id, "eos_ids": task.eos_ids}
  engine, closers = _rollout_engine(cfg, view, student, state.params, task, out_dir, engine_kw)
  # The JAX engine holds FP8/INT8 weights packed (real fp8/int8 arrays + scales); vLLM gets them
  # fake-quantized in the exported safetensors.
  pack = cfg.rollout.engine == "jax"
  view_transform = jax.jit(lambda p, step: view.transform(p, student.cfg.num_layers, step, pack=pack))

  def engine_params(step):
    """The params the engine samples with at `step`: lagged, noised, quantized per the view."""
    version, params = step, state.params
    if history is not None:
      history.push(step, state.params)
      version, params = history.lagged(view.lag)
    if view != EngineView(lag=view.lag):
      params = view_transform(params, version)
    return params, version

  held_out = HeldOut(student, teacher, task, sampling, loss_cfg.chunk, cfg.seed + 7, engine_kw)

  def evaluate(params, version):
    out, r = held_out(params, teacher_params, version)
    if teacher is not clean_teacher:  # the scoring teacher's own mismatch, on the same scale
      out["teacher_mismatch_exact_kl"] = float(teacher_kl(teacher_params, clean_teacher_params, batch_from_rollout(r)))
    return out

  def postfix(ev):
    return {k[:3]: f"{v:.4f}" for k, v in ev.items()}

  if resuming:
    records = _truncate_metrics(metrics_path, start)
    metrics_file = open(metrics_path, "a")
  else:
    last_eval = evaluate(state.params, 0)
    records = [{"step": 0, **last_eval}]
    metrics_file = open(metrics_path, "w" if ours else "x")
    metrics_file.write(json.dumps(records[0]) + "\n")
  bar = tqdm(range(start, cfg.train.steps), desc="OPD", unit="step", disable=not progress,
             initial=start, total=cfg.train.steps)
  bar.set_postfix(postfix(last_eval))
  t0 = time.time()
  pending = None  # step t-1's record, read to the host only after step t is dispatched

  def finish(p):
    rec, metrics, rollout, refs = p
    train_score = task.score(refs, rollout.completions())
    if train_score is not None:
      rec["train_accuracy"] = train_score
    rec.update({("train_reverse_kl" if k == "reverse_kl" else k): float(v) for k, v in metrics.items()})
    if "reverse_kl" not in rec:
      rec.update(last_eval)  # held-out numbers from the latest evaluation
    rec["elapsed_s"] = round(time.time() - t0, 3)
    metrics_file.write(json.dumps(rec) + "\n")
    metrics_file.flush()
    records.append(rec)
    if not np.isfinite(rec["loss"]) and cfg.train.on_nonfinite == "halt":
      ckpt.wait()
      raise UserError(f"non-finite loss at step {rec['step']}; halted. The last good checkpoint is step"
                      f" {ckpt.latest_step()} in {ckpt_dir} (set train.on_nonfinite=skip to skip such batches).")

  def meta(step):
    return {"step": step, "last_eval": last_eval, "config": cfg.to_dict(),
            "student_config": student.cfg.to_hf_dict(), "history_versions": history.versions if history else [],
            "engine": {"kind": cfg.rollout.engine, "view": str(view), "sampling": dataclasses.asdict(sampling)},
            "teacher_view": str(teacher_view), "params_version": step, "versions": package_versions()}

  every = cfg.train.checkpoint_every
  try:
    for step in bar:
      prompts, refs = task.train_batch(np.random.default_rng([cfg.seed, step]), cfg.rollout.batch_size)
      engine.sync(*engine_params(step))  # the clean view: on-policy, the current params
      rollout = engine.generate(prompts, sampling, seed=cfg.seed * 1_000_003 + step)
      _fault("rollout", step + 1)
      state, m = step_fn(state, teacher_params, batch_from_rollout(rollout))
      _fault("step", step + 1)
      if pending is not None:
        finish(pending)
      pending = ({"step": step + 1, "params_version": rollout.params_version,
                  "params_lag": step - rollout.params_version}, m, rollout, refs)
      if (step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps:
        last_eval = evaluate(state.params, step + 1)
        pending[0].update(last_eval)
        bar.set_postfix(postfix(last_eval))
      if (every and (step + 1) % every == 0) or step + 1 == cfg.train.steps:
        finish(pending)  # the record is on disk before the checkpoint that covers it
        pending = None
        tree = {"train": state, "history": history.params() if history else []}
        ckpt.save(step + 1, tree, meta(step + 1), metrics=last_eval)
        _fault("save", step + 1)
    if pending is not None:
      finish(pending)
    ckpt.wait()  # a failed asynchronous save (e.g. a full disk) raises here
  finally:
    metrics_file.close()
    for close in closers:
      close()
    ckpt.close()
  student_dir = os.path.join(out_dir, "student")
  if not os.path.exists(student_dir):
    save_hf_params(state.params, student.cfg.replace(dtype="float32"), student_dir)
  return records


def _rollout_engine(cfg, view: EngineView, student: Model, params, task, out_dir: str, engine_kw: dict):
  """(engine, [cleanups]) for `rollout.engine`: the embedded JAX engine or a vLLM server."""
  if cfg.rollout.engine == "jax":
    return JaxEngine(view.model(student), None, **engine_kw), []
  from opdjax.rollout.vllm_engine import VllmEngine, VllmServer

  if (view.compute_dtype, view.kv_quant, view.act_quant) != ("float32", "none", "none"):
    raise UserError(f"rollout.view={view} with rollout.engine='vllm': vLLM's own precision is set by"
                    " rollout.vllm.dtype / kv_cache_dtype / quantization; the view may only change weights,"
                    " noise and lag.")
  v = cfg.rollout.vllm
  closers = []
  server = v.url
  if not server:
    init_dir = os.path.join(out_dir, "vllm-init")  # the initial weights; every step syncs its own
    if not os.path.exists(init_dir):
      save_hf_params(params, student.cfg.replace(dtype="float32"), init_dir)
    server = VllmServer(
        init_dir, dtype=v.dtype, quantization=v.quantization or None, kv_cache_dtype=v.kv_cache_dtype or None,
        gpu_memory_utilization=v.gpu_memory_utilization or None, tensor_parallel_size=v.tensor_parallel_size,
        max_model_len=cfg.rollout.max_len, enforce_eager=v.enforce_eager, api_key=v.api_key or None,
        python=v.python or None, log_path=os.path.join(out_dir, "vllm.log"),
        env={"VLLM_CACHE_ROOT": os.path.join(out_dir, "vllm-cache"), "VLLM_CPU_KVCACHE_SPACE": str(v.cpu_kvcache_gib)})
    server.start()
    closers.append(server.stop)
  engine = VllmEngine(server, student.cfg, pad_id=engine_kw["pad_id"], eos_ids=engine_kw["eos_ids"],
                      api_key=v.api_key or None, export_dir=os.path.join(out_dir, "vllm-weights"))
  closers.insert(0, engine.close)
  return engine, closers


def _resume(ckpt: RunCheckpointer, state, history, student, fallback: bool):
  """(step, state, last_eval) from the newest checkpoint that restores; history refilled in place."""
  steps = sorted(ckpt.all_steps(), reverse=True)
  for path in ckpt.incomplete():
    print(f"opdjax: skipping incomplete checkpoint {path} (a save that never finished)", file=sys.stderr)
  if not steps:
    raise UserError(f"{ckpt.directory} has no complete checkpoint to resume from.")
  errors = []
  for step in steps:
    try:
      meta = ckpt.read_meta(step)
      if meta["student_config"] != student.cfg.to_hf_dict():
        raise UserError(
            f"checkpoint step {step} in {ckpt.directory} is of a different student model"
            f" ({_config_diff(meta['student_config'], student.cfg.to_hf_dict())}); resume with the config it was"
            " written with, or pass a new --out folder. Nothing was overwritten.")
      target = {"train": state, "history": [state.params] * len(meta["history_versions"])}
      tree, meta = ckpt.restore(step, target)
    except UserError as e:
      if not fallback or "different student model" in str(e):
        raise
      errors.append(str(e))
      continue
    if errors:
      print("opdjax: skipped unreadable checkpoints: " + " | ".join(errors), file=sys.stderr)
    if history is not None:
      for version, params in zip(meta["history_versions"], tree["history"]):
        history.push(version, params)
    return step, tree["train"], meta["last_eval"]
  raise UserError("no checkpoint could be restored: " + " | ".join(errors))


def _config_diff(a: dict, b: dict) -> str:
  keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  return ", ".join(f"{k}: {a.get(k)} in the checkpoint, {b.get(k)} now" for k in keys[:4])
