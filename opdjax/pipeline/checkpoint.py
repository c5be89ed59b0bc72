"""Orbax checkpoints of a whole OPD run, and resuming from them exactly.

A checkpoint at step s holds everything the run needs to continue as if never stopped: the
`TrainState` (student params, optimizer state, step), the buffer of past params versions that
lagged rollouts sample from, and JSON metadata (the config, the student's HF config, the engine
settings the sampler ran with, the mismatch guard's state, the latest held-out evaluation, package
versions). `RunState` is that content, and the one place that writes and reads it: the checkpoint
hook saves one, resume and export restore one. Everything random in the loop is derived from
(seed, step), so no RNG state needs saving.

Saves are asynchronous (Orbax `CheckpointManager`); the last `keep` are kept, plus the best by
`best_metric` under checkpoints/best (hard links to latest's files of that step: stored once).
Orbax writes each step to a temporary folder and renames it only when complete, so a crash during a
save leaves no checkpoint that restores; `latest_step` reports the newest complete one. A checkpoint
that cannot be read raises `CheckpointUnreadable`, one line; the full error goes to
checkpoints/restore_errors.log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from opdjax.errors import UserError
from opdjax.pipeline.quiet import HeldStderr, LoopClosedNoise
from opdjax.views.view import EngineView


def package_versions() -> dict[str, str]:
  out = {}
  for name in ("opdjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def _barriers(prefix: str):
  return ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=prefix)


class CheckpointWriteError(OSError):
  """A save failed (full disk, lost mount, ...); the checkpoints before it are complete and intact."""


class CheckpointUnreadable(UserError):
  """Checkpoint `step` cannot be read (truncated, corrupted, or not of this model's shapes). The message
  is one line; `log` holds the full error (TensorStore's spec, the traceback)."""

  def __init__(self, step: int, path: str, cause: str, log: str):
    super().__init__(f"checkpoint step {step} at {path} cannot be restored ({cause}); it is truncated, corrupted,"
                     f" or from a different model (the full error is in {log}).")
    self.step, self.path, self.cause, self.log = step, path, cause, log


class CheckpointOfAnotherModel(UserError):
  """The checkpoint holds a student of other shapes than this run's: a refusal, not a damaged checkpoint."""


@dataclasses.dataclass
class RunState:
  """A whole OPD run at a checkpointed step: the tree Orbax stores (`train`, `history`) and the JSON
  metadata beside it. The one description of the checkpoint format; `RunCheckpointer.save_run` and
  `restore_run` write and read both halves together."""

  step: int
  train: Any  # TrainState: student params, optimizer state, step
  history_versions: list[int]  # the params versions a lagged view samples from, oldest first ...
  history: list  # ... and their params
  last_eval: dict | None  # the latest held-out evaluation (with its eval_step)
  config: dict  # Config.to_dict() of the run
  student_config: dict  # the student's HF config: a resume refuses another model
  kind: str  # the deployment (opdjax.rollout.deploy: jax, vllm, ...)
  view: EngineView  # the rollout view and asynchronous depth the sampler ran with at this step:
  depth: int  # the config's, or where the mismatch guard's backoffs took them
  async_mode: str
  sampling: dict  # SamplingParams fields
  teacher_view: str
  guard: dict | None = None  # GuardHook.state() of a run with train.budget
  length_guard: dict | None = None  # LengthGuardHook.state() (opdjax.pipeline.telemetry): its window
  collapse_guard: dict | None = None  # CollapseGuardHook.state(): its window and reference
  versions: dict = dataclasses.field(default_factory=dict)  # package versions that wrote it

  @classmethod
  def of(cls, loop, step: int, guard: dict | None = None, length_guard: dict | None = None,
         collapse_guard: dict | None = None) -> RunState:
    """What a checkpoint of `loop` at `step` holds (`guard`, `length_guard`: the mismatch and length guards'
    states, where the run has them)."""
    session, sampler = loop.session, loop.sampler
    h = sampler.history
    return cls(step=step, train=loop.state, history_versions=h.versions if h else [], history=h.params() if h else [],
               last_eval=loop.last_eval, config=session.cfg.to_dict(), student_config=session.student.cfg.to_hf_dict(),
               kind=session.deployment.kind, view=sampler.view, depth=sampler.depth,
               async_mode=session.cfg.rollout.async_mode, sampling=dataclasses.asdict(session.sampling),
               teacher_view=str(session.teacher_view), guard=guard, length_guard=length_guard,
               collapse_guard=collapse_guard, versions=package_versions())

  def tree(self) -> dict:
    return {"train": self.train, "history": self.history}

  def meta(self) -> dict:
    out = {"step": self.step, "last_eval": self.last_eval, "config": self.config, "student_config": self.student_config,
           "history_versions": self.history_versions,
           "engine": {"kind": self.kind, "view": str(self.view), "view_fields": dataclasses.asdict(self.view),
                      "async_depth": self.depth, "async_mode": self.async_mode, "sampling": self.sampling},
           "teacher_view": self.teacher_view, "params_version": self.step, "versions": self.versions}
    if self.guard is not None:
      out["guard"] = self.guard
    if self.length_guard is not None:
      out["length_guard"] = self.length_guard
    if self.collapse_guard is not None:
      out["collapse_guard"] = self.collapse_guard
    return out

  @staticmethod
  def target(meta: dict, train) -> dict:
    """The tree to restore a checkpoint with metadata `meta` into: `train`'s structure, shapes and
    shardings, for the train state and for each params version of the history."""
    return {"train": train, "history": [train.params] * len(meta["history_versions"])}

  @classmethod
  def from_checkpoint(cls, tree: dict, meta: dict) -> RunState:
    engine = meta["engine"]
    view = EngineView(**engine["view_fields"]) if "view_fields" in engine else EngineView.parse(engine["view"])
    return cls(step=meta["step"], train=tree["train"], history_versions=list(meta["history_versions"]),
               history=list(tree["history"]), last_eval=meta["last_eval"], config=meta["config"],
               student_config=meta["student_config"], kind=engine.get("kind", ""), view=view,
               depth=engine["async_depth"], async_mode=engine.get("async_mode", "exact"), sampling=engine["sampling"],
               teacher_view=meta.get("teacher_view", "clean"), guard=meta.get("guard"),
               length_guard=meta.get("length_guard"), collapse_guard=meta.get("collapse_guard"),
               versions=meta.get("versions", {}))


class RunCheckpointer:
  def __init__(self, directory: str, keep: int = 3, best_metric: str = "", best_mode: str = "min"):
    self.directory = os.path.abspath(directory)
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True,
                                        multiprocessing_options=_barriers("latest"))
    self._latest = ocp.CheckpointManager(os.path.join(self.directory, "latest"), options=opts)
    self.best_metric, self.best_mode = best_metric, best_mode
    self._best_dir = os.path.join(self.directory, "best")
    self._best = _read_json(os.path.join(self._best_dir, BEST_FILE)) if best_metric else None
    self._pending_best: tuple[int, float] | None = None

  def latest_step(self) -> int | None:
    return self._latest.latest_step()

  def settled(self) -> str:
    """Waits for the pending saves; where the run is checkpointed now, as a sentence of a halt's message."""
    self.wait()
    return f"The run is checkpointed at step {self.latest_step()} in {self.directory}."

  def all_steps(self) -> list[int]:
    return list(self._latest.all_steps())

  def incomplete(self) -> list[str]:
    """Folders of saves that never finished (a crash mid-save); Orbax never restores them."""
    root = os.path.join(self.directory, "latest")
    if not os.path.isdir(root):
      return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if ".orbax-checkpoint-tmp" in d)

  def save(self, step: int, state_tree, meta: dict, metrics: dict | None = None) -> None:
    with _ctrl_c_held(), self._writing("in flight"):  # Orbax would wait for the previous save here anyway
      self._latest.wait_until_finished()
    self._publish_best()
    # Copy first: the next train step donates the live buffers while the save may still run.
    state_tree = jax.tree.map(jnp.copy, state_tree)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state_tree), meta=ocp.args.JsonSave(meta))
    with _ctrl_c_held(), self._writing(step):
      self._latest.save(step, args=args)
    if self.best_metric and metrics and self.best_metric in metrics:
      value = float(metrics[self.best_metric])
      best = self._pending_best or ((self._best["step"], self._best["value"]) if self._best else None)
      if best is None or (value < best[1] if self.best_mode == "min" else value > best[1]):
        self._pending_best = (step, value)

  def save_run(self, run: RunState, metrics: dict | None = None) -> None:
    """Saves `run` (tree and metadata) as checkpoint `run.step`; `metrics` rank it for checkpoints/best."""
    self.save(run.step, run.tree(), run.meta(), metrics)

  def restore_run(self, step: int, train, student_config: dict | None = None) -> RunState:
    """Checkpoint `step` as a RunState, its train state restored into the structure, shapes and
    shardings of `train` (a TrainState, concrete or abstract). `student_config`: this run's student,
    refused before any array is read when the checkpoint's differs (CheckpointOfAnotherModel)."""
    meta = self.read_meta(step)
    if student_config is not None and meta["student_config"] != student_config:
      diff = _dict_diff(meta["student_config"], student_config)
      raise CheckpointOfAnotherModel(
          f"checkpoint step {step} in {self.directory} is of a different student model ({diff}); resume with the"
          " config it was written with, or pass a new --out folder. Nothing was overwritten.")
    tree, meta = self.restore(step, RunState.target(meta, train))
    return RunState.from_checkpoint(tree, meta)

  def _publish_best(self) -> None:
    """Makes the pending best step (its save finished) the one under checkpoints/best: a tree of hard
    links to latest's files, so a step both hold is stored once, and best keeps it when latest rotates
    it out. The folder is an Orbax checkpoint directory (best/STEP) with BEST_FILE beside it."""
    if self._pending_best is None:
      return
    step, value = self._pending_best
    self._pending_best = None
    src = os.path.join(self.directory, "latest", str(step))
    if jax.process_index() != 0 or not os.path.isdir(src):
      return
    tmp, old = f"{self._best_dir}.tmp", f"{self._best_dir}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, os.path.join(tmp, str(step)), copy_function=_link_or_copy)
    self._best = {"metric": self.best_metric, "mode": self.best_mode, "step": step, "value": value}
    with open(os.path.join(tmp, BEST_FILE), "w") as f:
      json.dump(self._best, f)
    if os.path.isdir(self._best_dir):
      os.replace(self._best_dir, old)
    os.replace(tmp, self._best_dir)
    shutil.rmtree(old, ignore_errors=True)

  @contextlib.contextmanager
  def _writing(self, step):
    # Orbax reports a failed background write at the next save or wait, from tensorstore or from
    # Python I/O: either way it becomes one OSError naming the folder.
    try:
      yield
    except Exception as e:  # noqa: BLE001
      raise CheckpointWriteError(f"writing checkpoint {step} under {self.directory} failed: {e}") from e

  def read_meta(self, step: int) -> dict:
    LoopClosedNoise.install()
    try:
      return self._latest.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 -- as `restore`: one error with the step and path
      raise self._unreadable(step, e) from e

  def quarantine(self, step: int, reason: str) -> str:
    """Moves checkpoint `step`, found unreadable, to checkpoints/corrupt/STEP with a one-line REASON,
    so that resume and export never list it again (nothing is deleted). Returns where it went."""
    src = os.path.join(self.directory, "latest", str(step))
    dst = os.path.join(self.directory, "corrupt", str(step))
    if jax.process_index() == 0:
      if os.path.exists(dst):
        dst = f"{dst}.{time.strftime('%Y%m%d-%H%M%S')}"
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      os.replace(src, dst)
      with open(os.path.join(dst, "REASON"), "w") as f:
        f.write(" ".join(reason.split()) + "\n")
    self._latest.reload()
    return dst

  def restore(self, step: int, target) -> tuple[object, dict]:
    """Restores `step` into the structure, shapes and shardings of `target`."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    held = HeldStderr()
    LoopClosedNoise.install()
    try:
      with held:
        out = self._latest.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 -- any failure to read is reported with the step and path
      raise self._unreadable(step, e, held.text) from e
    return out["state"], out["meta"]

  def _unreadable(self, step: int, e: Exception, printed: str = "") -> CheckpointUnreadable:
    """The one-line error for an unreadable checkpoint; the full one (with what the restore printed)
    appended to restore_errors.log, where the TensorStore callbacks that fire after a failed restore
    also go (`LoopClosedNoise`)."""
    path = os.path.join(self.directory, "latest", str(step))
    name = "restore_errors.log" if jax.process_index() == 0 else f"restore_errors.process{jax.process_index()}.log"
    entry = (f"== {time.strftime('%Y-%m-%d %H:%M:%S')}: checkpoint step {step} at {path}\n"
             + "".join(traceback.format_exception(e)) + (f"-- printed during it:\n{printed}" if printed else ""))
    for log in (os.path.join(self.directory, name), os.path.join(tempfile.gettempdir(), f"opdjax_{name}")):
      try:  # (a checkpoint folder we may not write to, e.g. one exported from: the temp folder)
        with open(log, "a") as f:
          f.write(entry)
        break
      except OSError:
        continue
    LoopClosedNoise.route_to(log)
    return CheckpointUnreadable(step, path, f"{type(e).__name__}: {_short(e)}", log)

  def wait(self) -> None:
    with _ctrl_c_held(), self._writing("in flight"):
      self._latest.wait_until_finished()
    self._publish_best()

  def close(self) -> None:
    # The run is ending (normally or from a Ctrl-C already reported): a second Ctrl-C here must not
    # cut the last save short, and has nothing left to stop.
    with _ctrl_c_held(reraise=False), self._writing("in flight"):
      self._latest.close()
    self._publish_best()


@contextlib.contextmanager
def _ctrl_c_held(reraise: bool = True):
  """Holds a Ctrl-C (SIGINT) that lands while Orbax saves or waits for a save, and raises it as
  KeyboardInterrupt once Orbax has returned. Interrupted inside, Orbax's thread join logs an ERROR
  with a traceback and may leave the step's save unfinished. Off the main thread (no signals
  arrive there) it does nothing."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  held = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
  try:
    yield
  finally:  # (None: a handler not set from Python; the default one raises KeyboardInterrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
  if held and reraise:
    raise KeyboardInterrupt


BEST_FILE = "BEST.json"  # {"metric", "mode", "step", "value"} of the step under checkpoints/best


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def _link_or_copy(src: str, dst: str) -> None:
  try:
    os.link(src, dst)
  except OSError:  # a filesystem without hard links: a copy
    shutil.copy2(src, dst)


def _short(e: Exception, limit: int = 200) -> str:
  """The cause on one line, without TensorStore's spec dumps (tens of lines of JSON that bury it)."""
  text = re.sub(r"\s*\[tensorstore_spec[^\]]*'\]", "", str(e))
  text = re.split(r"\s*See full TensorStore details", text)[0]
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit] + " ..."


def _dict_diff(a: dict, b: dict) -> str:
  keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  return ", ".join(f"{k}: {a.get(k)} in the checkpoint, {b.get(k)} now" for k in keys[:4])


def restore_student(run_dir: str, step: int | None = None):
  """(model, params, meta) of the student in a run's checkpoint (the latest when `step` is None)."""
  from opdjax.models import Model, ModelConfig
  from opdjax.training.step import OptimConfig, TrainState, make_optimizer

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
  run_root = run_dir if os.path.isdir(os.path.join(run_dir, "checkpoints")) else os.path.dirname(run_dir.rstrip("/"))
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
