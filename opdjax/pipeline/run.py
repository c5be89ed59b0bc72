"""`opdjax train`: one OPD run into an output folder, resumable.

Checks --out before creating anything; resumes from the latest checkpoint with the config it was
written with (changes that alter what the run means are refused, listing the keys; changes that only
extend or observe it are allowed, printed and recorded in OUT/config_history.jsonl); then runs the
loop with its hooks and writes the student as an HF folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import sys
import threading

import jax

from opdjax.config.schema import Config, flat
from opdjax.config.train_section import gone
from opdjax.errors import Interrupted, UserError
from opdjax.models.fetch import resolve
from opdjax.models.hub import read_snapshots
from opdjax.pipeline import hooks as H
from opdjax.pipeline.checkpoint import CheckpointUnreadable, RunCheckpointer, RunState
from opdjax.pipeline.distributed import barrier
from opdjax.pipeline.export import TOKENIZER_FILES
from opdjax.pipeline.guards import load_run_budget
from opdjax.pipeline.loop import run_loop
from opdjax.pipeline.outdir import check_out_dir, is_run_dir, mark_run_dir
from opdjax.pipeline.session import Session
from opdjax.pipeline.writers import check_installed
from opdjax.rollout.deploy import check_memory, plan, resolve_servers
from opdjax.training.step import with_schedule
from opdjax.views.view import EngineView

# Keys a resumed run may change: they extend it (more steps) or only observe it.
RESUMABLE = ("train.steps", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints",
             "train.best_metric", "train.loggers", "train.tracker_project",
             "train.log_samples_every", "train.length_guard", "train.length_guard_threshold",
             "train.length_guard_window", "train.collapse_guard", "train.collapse_guard_ratio",
             "train.collapse_guard_window", "rollout.vllm.url", "rollout.vllm.api_key",
             "rollout.vllm.python", "rollout.vllm.gpu_memory_utilization", "rollout.vllm.cpu_kvcache_gib",
             "rollout.vllm.enforce_eager", "rollout.vllm.extra_args", "rollout.devices", "rollout.vllm.urls",
             "rollout.vllm.num_servers", "rollout.vllm.gpus",
             "mismatch.", "sensitivity.", "prefix_shift.", "calibrate.", "admit.",
             "mesh.")  # a checkpoint restores into any mesh and process count
# The server settings a section keeps as 'auto' (None) when opdjax starts no server from it (the JAX engine,
# attached servers: deploy.resolve_servers): nothing ran with them, so they match any value.
UNRESOLVED = {"rollout.vllm.dtype": "auto", "rollout.vllm.enforce_eager": None, "teacher.vllm.dtype": "auto",
              "teacher.vllm.enforce_eager": None}


@dataclasses.dataclass
class TrainResult:
  records: list[dict]  # this invocation's records (step 0 included for a fresh run)
  start_step: int
  final_step: int
  resumed: bool
  config_changes: dict

  def summary(self) -> str:
    if self.final_step == self.start_step:
      return f"the run was already complete at step {self.final_step}; nothing ran (raise train.steps to extend it)"
    first, last = self.records[0], self.records[-1]
    verb = f"resumed at step {self.start_step}, ran to" if self.resumed else "ran"
    shown = ("reverse_kl", "teacher_nll", "teacher_f1", "accuracy")
    parts = [f"held-out {k} {first[k]:.4f} -> {last[k]:.4f}" for k in shown if k in first and k in last]
    return f"{verb} step {self.final_step}: " + "; ".join(parts)


def config_changes(old: dict, new: dict) -> tuple[dict, dict]:
  """(refused, allowed) changes between a checkpoint's config and the new one: {key: (old, new)}."""
  a, b = flat(old), flat(new)
  defaults = flat(Config().to_dict())
  # A key newer than the checkpoint, at its default, is what the run did before the key existed.
  diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
          if a.get(k) != b.get(k) and not gone(k) and not (k not in a and b.get(k) == defaults.get(k))
          and not (k in UNRESOLVED and UNRESOLVED[k] in (a.get(k), b.get(k)))}
  allowed = {k: v for k, v in diff.items() if k in RESUMABLE or k.startswith(tuple(p for p in RESUMABLE
                                                                                   if p.endswith(".")))}
  return {k: v for k, v in diff.items() if k not in allowed}, allowed


def train(cfg: Config, out_dir: str, resume: str = "auto", fallback: bool = False, overwrite: bool = False,
          progress: bool = True, command: str = "") -> TrainResult:
  """OPD for `cfg.train.steps` steps into `out_dir`. `resume`: auto (resume when out_dir has a
  checkpoint), require (error if it has none) or never. `fallback`: when the latest checkpoint cannot
  be restored, use the previous good one. `command`: the command line that ran this, for messages
  that say what to run next."""
  cfg = resolve_servers(cfg)  # the servers' dtype and CUDA graphs as they will run: recorded, and resumes compare them
  check_installed(cfg.train.loggers)  # a tracker that is not installed: one line, before --out is touched
  note = cfg.optim.note(cfg.train.steps)  # a schedule that does not fit the run: said, not refused
  if note and jax.process_index() == 0:
    print(note, file=sys.stderr)
  ckpt_dir = os.path.join(out_dir, "checkpoints")
  ours = is_run_dir(out_dir)
  check_out_dir(out_dir, "train", overwrite, own=ours)
  has_ckpt = os.path.isdir(os.path.join(ckpt_dir, "latest")) and any(
      d.isdigit() for d in os.listdir(os.path.join(ckpt_dir, "latest")))
  resuming = resume != "never" and has_ckpt
  if resume == "require" and not resuming:
    raise UserError(f"--resume: no checkpoint under {ckpt_dir}.")
  if has_ckpt and resume == "never":
    raise UserError(f"{out_dir} already holds a run's checkpoints; pass a new --out folder.")
  config_path = os.path.join(out_dir, "config.json")
  if resuming and os.path.isfile(config_path):  # the run's config: refused before models load or servers start
    with open(config_path) as f:
      _resumable_changes(out_dir, json.load(f), cfg, early=True)
  deployment = plan(cfg)  # devices, cores, servers (process 0 checks those it attaches to): before any write
  if jax.process_count() > 1:
    barrier("opdjax-out-checked")  # every process has read --out before process 0 writes into it
  session = Session(cfg, out_dir, progress, deployment)  # loads models: errors about them come before any write
  try:
    if cfg.rollout.async_depth:  # the engine's devices and memory, before any write
      side = deployment.engine_side(session.placement, session.student.cfg, cfg.rollout.devices)
      check_memory(side, session.student_params, cfg.rollout.async_depth, EngineView.parse(cfg.rollout.view))
    budget = load_run_budget(cfg.train.budget, session) if cfg.train.budget else None
    if cfg.teacher.preflight:  # the served teacher admitted against the budget before anything is trained
      _preflight(session)
    with sigterm_as_interrupt() as signalled:
      return _train(session, out_dir, ckpt_dir, resuming, fallback, progress, budget, command)
  except Interrupted as e:
    steps = [int(d) for d in os.listdir(os.path.join(ckpt_dir, "latest")) if d.isdigit()] \
        if os.path.isdir(os.path.join(ckpt_dir, "latest")) else []
    where = f"resumes from step {max(steps)}" if steps else "starts the run again (no checkpoint was complete)"
    by = " (SIGTERM)" if signalled else ""
    raise Interrupted(e.step, f"interrupted{by} during step {e.step}, after step {e.finished} finished; the same"
                      f" command {where}.", e.finished) from None
  finally:
    session.close()


@contextlib.contextmanager
def sigterm_as_interrupt():
  """SIGTERM (SLURM's preemption, `kill`) handled as a Ctrl-C: through the SIGINT handler in force (which holds
  it while a checkpoint is being written), so the run checkpoints its last finished step and exits. Yields a
  list that holds "SIGTERM" once one arrived. Off the main thread (no signals arrive there) it does nothing."""
  signalled: list[str] = []
  if threading.current_thread() is not threading.main_thread():
    yield signalled
    return

  def on_term(signum, frame):
    signalled.append("SIGTERM")
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
      handler(signal.SIGINT, frame)
    else:
      raise KeyboardInterrupt

  previous = signal.signal(signal.SIGTERM, on_term)
  try:
    yield signalled
  finally:
    signal.signal(signal.SIGTERM, previous)


def _preflight(session: Session) -> None:
  from opdjax.pipeline.teacher_preflight import preflight, refusal, report

  if jax.process_count() > 1:
    raise UserError("teacher.preflight runs in one trainer process: run `opdjax admit --teacher` with this config"
                    " first (one process), then the run with teacher.preflight off.")
  result = preflight(session.cfg, session=session, progress=False)
  print(report(result), file=sys.stderr)
  if not result["admitted"]:
    raise UserError(f"teacher.preflight refused the served teacher (the table above): {refusal(result)} Nothing was"
                    " trained.")


def _resumable_changes(out_dir: str, old: dict, cfg: Config, early: bool = False) -> dict:
  """The changes a resume of the run written with config `old` may make (config_changes' allowed);
  any other change is refused, naming the keys. `early` (from OUT/config.json, before the models
  load) leaves a changed student to the checkpoint's model check, which names the differing shapes."""
  refused, changes = config_changes(old, cfg.to_dict())
  if refused and not (early and any(k.startswith("student.") for k in refused)):
    listed = "; ".join(f"{k}: {a!r} in the run, {b!r} now" for k, (a, b) in list(refused.items())[:8])
    raise UserError(f"{out_dir} holds a run with another config ({listed}). These change what the run means;"
                    " resume with the config it was written with, or pass a new --out folder. Nothing was"
                    " overwritten.")
  return changes


def _train(session: Session, out_dir: str, ckpt_dir: str, resuming: bool, fallback: bool,
           progress: bool, budget: float | None, command: str = "") -> TrainResult:
  cfg = session.cfg
  primary = session.placement.primary  # process 0 writes the run's files
  view, depth, guard_states = EngineView.parse(cfg.rollout.view), cfg.rollout.async_depth, None
  state, start, last_eval, history, changes = None, 0, None, None, {}
  if resuming:
    ckpt = RunCheckpointer(ckpt_dir, keep=cfg.train.keep_checkpoints, best_metric=cfg.train.best_metric)
    try:
      # The restore target: checkpoints restore into the shapes and shardings of a new state.
      fresh = session.new_state()
      run = _resume(ckpt, fresh, session, fallback, command)
      changes = _resumable_changes(out_dir, run.config, cfg)
    except BaseException:
      ckpt.close()
      raise
    # The optimizer state as saved, the schedule's hyperparameters as this config gives them (train.steps may grow).
    start, state, last_eval = run.step, with_schedule(run.train, fresh), run.last_eval
    history = (run.history_versions, run.history)
    del fresh  # its params and moments: a second copy of the student's state
    # The sampler as it ran at the checkpoint: the config's view and depth, or where the guard's backoffs took them.
    view, depth = run.view, run.depth
    # The guards' windows: the resumed run's guards act where the uninterrupted run's would.
    guard_states = {"guard": run.guard, "length_guard": run.length_guard, "collapse_guard": run.collapse_guard}
    for k, (a, b) in changes.items():
      print(f"opdjax: resuming with {k} changed: {a!r} -> {b!r}", file=sys.stderr)
  else:
    if primary:
      mark_run_dir(out_dir)
    ckpt = RunCheckpointer(ckpt_dir, keep=cfg.train.keep_checkpoints, best_metric=cfg.train.best_metric)
    if primary:
      _write_json(os.path.join(out_dir, "config.json"), cfg.to_dict())
  if primary:
    _append_history(out_dir, cfg, start, changes, resuming)

  hooks = H.assemble(cfg, out_dir, ckpt, start if resuming else -1, primary, progress, budget, guard_states)
  if start >= cfg.train.steps:
    ckpt.close()
    loop_records, final_state = [], state
  else:
    loop = run_loop(session, view=view, seed=cfg.seed, steps=cfg.train.steps, hooks=hooks, state=state,
                    history=history, start=start, last_eval=last_eval, async_depth=depth,
                    async_mode=cfg.rollout.async_mode, devices=cfg.rollout.devices, timed=cfg.train.timed or None)
    loop_records, final_state = loop.records, loop.state
  if resuming and loop_records and last_eval:
    loop_records = [{"step": start, **last_eval}, *loop_records]
  _export(session, final_state.params, os.path.join(out_dir, "student"), overwrite=bool(loop_records))
  return TrainResult(loop_records, start, max(start, cfg.train.steps), resuming, changes)


def _export(session: Session, params, folder: str, overwrite: bool) -> None:
  """The trained student as an HF folder, with the tokenizer files of the model folder it came from."""
  if overwrite and os.path.isdir(folder) and jax.process_index() == 0:
    shutil.rmtree(folder)  # our own export of an earlier, shorter invocation of this run
  extra = {}
  cfg = session.cfg
  src = cfg.student.path or cfg.teacher.path
  src = resolve(src) if src else ""
  for name in TOKENIZER_FILES:
    if src and os.path.exists(os.path.join(src, name)):
      with open(os.path.join(src, name)) as f:
        extra[name] = f.read()
  session.export_student(params, folder, extra)


def _write_json(path: str, obj) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(path + ".tmp", path)


def _append_history(out_dir: str, cfg: Config, start: int, changes: dict, resumed: bool) -> None:
  entry = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "start_step": start,
           "resumed": resumed, "changes": {k: list(v) for k, v in changes.items()}}
  if not resumed:
    entry["config"] = cfg.to_dict()
  snapshots = read_snapshots()  # the Hub snapshot commit each Hub id of this start read
  if snapshots:
    entry["hub_snapshots"] = snapshots
  with open(os.path.join(out_dir, "config_history.jsonl"), "a") as f:
    f.write(json.dumps(entry) + "\n")


def _resume(ckpt: RunCheckpointer, state, session: Session, fallback: bool, command: str) -> RunState:
  """The newest checkpoint that restores into `state`'s shapes and shardings. One that cannot be read
  is moved to checkpoints/corrupt/ (nothing is deleted); without `fallback` the run stops there with
  one line saying which step moved where, and what resumes from the step before."""
  steps = sorted(ckpt.all_steps(), reverse=True)
  for path in ckpt.incomplete():
    print(f"opdjax: skipping incomplete checkpoint {path} (a save that never finished)", file=sys.stderr)
  if not steps:
    raise UserError(f"{ckpt.directory} has no complete checkpoint to resume from.")
  errors, log = [], ""
  for step in steps:
    try:
      run = ckpt.restore_run(step, state, student_config=session.student.cfg.to_hf_dict())
    except CheckpointUnreadable as e:  # (a checkpoint of another model is a refusal: raised as it is)
      moved, log = ckpt.quarantine(step, str(e)), e.log
      earlier = [s for s in steps if s < step]
      if not fallback:
        again = f"`{command}`" if command else "the same command"
        then = (f"{again} now resumes from step {earlier[0]} (--resume-fallback would have gone on at once)"
                if earlier else "no other checkpoint is left: pass a new --out folder")
        raise UserError(f"checkpoint step {step} cannot be restored ({e.what}; the error is in"
                        f" {e.log}); moved it to {moved}; {then}.") from None
      errors.append(f"step {step} ({e.what}; moved to {moved})")
      continue
    if errors:
      print(f"opdjax: skipped unreadable checkpoints: {', '.join(errors)}; the errors are in {log}", file=sys.stderr)
    return run
  raise UserError(f"no checkpoint could be restored: {', '.join(errors)}; the errors are in {log}.")
