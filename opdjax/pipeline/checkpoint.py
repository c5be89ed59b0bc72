"""Orbax checkpoints of a whole OPD run (a `RunState`, opdjax.pipeline.run_state), verified at restore.

Saves are asynchronous (Orbax `CheckpointManager`); the last `keep` are kept, plus the best by
`best_metric` under checkpoints/best: its own copy of that step's files, so damage to one never damages
the other. Orbax writes each step to a temporary folder and renames it only when complete, so a crash
during a save leaves no checkpoint that restores; `latest_step` reports the newest complete one.

Every saved array's content checksum (opdjax.pipeline.checksums: over all processes' shards, independent
of the sharding) is recorded in the metadata at save (`checksums`) and compared at restore. A checkpoint
that cannot be read, or whose arrays differ from what was saved (a flipped bit that still decodes), raises
`CheckpointUnreadable`, one line naming the step (and the array); the full error goes to
checkpoints/restore_errors.log, and resume quarantines the step and uses the newest intact one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from opdjax.errors import UserError
from opdjax.pipeline.checksums import mismatches, tree_checksums
from opdjax.pipeline.quiet import HeldStderr, LoopClosedNoise, ctrl_c_held
from opdjax.pipeline.run_state import RunState, check_layout, package_versions  # noqa: F401 -- their users import them

CHECKSUMS = "checksums"  # the metadata key: {array path: checksum} of the saved tree


def _barriers(prefix: str):
  return ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=prefix)


class CheckpointWriteError(OSError):
  """A save failed (full disk, lost mount, ...); the checkpoints before it are complete and intact."""


class CheckpointUnreadable(UserError):
  """Checkpoint `step` cannot be read (truncated, corrupted, or not of this model's shapes). The message
  is one line; `log` holds the full error (TensorStore's spec, the traceback)."""

  what = "truncated or corrupted"  # what resume's one line says of it

  def __init__(self, step: int, path: str, cause: str, log: str):
    super().__init__(f"checkpoint step {step} at {path} cannot be restored ({cause}); it is truncated, corrupted,"
                     f" or from a different model (the full error is in {log}).")
    self.step, self.path, self.cause, self.log = step, path, cause, log


class CheckpointCorrupt(CheckpointUnreadable):
  """Checkpoint `step` decodes, but array `array` (and `more` others) differs from what was saved: its files
  changed after the save (a flipped bit, a bad disk or copy)."""

  def __init__(self, step: int, path: str, array: str, more: int, log: str):
    also = f" and {more} other array(s)" if more else ""
    UserError.__init__(self, f"checkpoint step {step} at {path} is corrupted: array {array}{also} fails its content"
                       f" checksum (its files changed after the save; the detail is in {log}).")
    self.step, self.path, self.cause, self.log = step, path, f"array {array}{also} fails its checksum", log
    self.what = f"corrupted: array {array}{also} fails its content checksum"


class CheckpointOfAnotherModel(UserError):
  """The checkpoint holds a student of other shapes than this run's: a refusal, not a damaged checkpoint."""


class RunCheckpointer:
  """The run's checkpoints under `directory`: steps in `directory/latest` (`steps_in="best"`: the best step's
  own copy, read on its own)."""

  def __init__(self, directory: str, keep: int = 3, best_metric: str = "", best_mode: str = "min",
               steps_in: str = "latest"):
    self.directory = os.path.abspath(directory)
    self._root = os.path.join(self.directory, steps_in)
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True,
                                        multiprocessing_options=_barriers(steps_in))
    self._latest = ocp.CheckpointManager(self._root, options=opts)
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
    root = self._root
    if not os.path.isdir(root):
      return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if ".orbax-checkpoint-tmp" in d)

  def save(self, step: int, state_tree, meta: dict, metrics: dict | None = None) -> None:
    with ctrl_c_held(), self._writing("in flight"):  # Orbax would wait for the previous save here anyway
      self._latest.wait_until_finished()
    self._publish_best()
    # Copy first: the next train step donates the live buffers while the save may still run.
    state_tree = jax.tree.map(jnp.copy, state_tree)
    meta = {**meta, CHECKSUMS: tree_checksums(state_tree)}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state_tree), meta=ocp.args.JsonSave(meta))
    with ctrl_c_held(), self._writing(step):
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
    check_layout(meta, step, self.directory)
    if student_config is not None and meta["student_config"] != student_config:
      diff = _dict_diff(meta["student_config"], student_config)
      raise CheckpointOfAnotherModel(
          f"checkpoint step {step} in {self.directory} is of a different student model ({diff}); resume with the"
          " config it was written with, or pass a new --out folder. Nothing was overwritten.")
    tree, meta = self.restore(step, RunState.target(meta, train))
    return RunState.from_checkpoint(tree, meta)

  def _publish_best(self) -> None:
    """Makes the pending best step (its save finished) the one under checkpoints/best: a copy of latest's
    files (not links: a flipped bit in one must not be in both, and quarantining latest's step must leave
    best whole), carrying the same checksums, so it is verified on its own. The folder is an Orbax
    checkpoint directory (best/STEP) with BEST_FILE beside it."""
    if self._pending_best is None:
      return
    step, value = self._pending_best
    self._pending_best = None
    src = os.path.join(self.directory, "latest", str(step))
    if jax.process_index() != 0 or not os.path.isdir(src):
      return
    tmp, old = f"{self._best_dir}.tmp", f"{self._best_dir}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, os.path.join(tmp, str(step)))
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
    src = os.path.join(self._root, str(step))
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
    meta = dict(out["meta"])
    bad = mismatches(meta.pop(CHECKSUMS, {}), out["state"])
    if bad:
      path = os.path.join(self._root, str(step))
      log = self._log(step, f"arrays whose content differs from the checksum recorded at save: {', '.join(bad)}\n")
      raise CheckpointCorrupt(step, path, bad[0], len(bad) - 1, log)
    return out["state"], meta

  def _unreadable(self, step: int, e: Exception, printed: str = "") -> CheckpointUnreadable:
    """The one-line error for an unreadable checkpoint; the full one (with what the restore printed)
    appended to restore_errors.log, where the TensorStore callbacks that fire after a failed restore
    also go (`LoopClosedNoise`)."""
    path = os.path.join(self._root, str(step))
    log = self._log(step, "".join(traceback.format_exception(e)) + (f"-- printed during it:\n{printed}" if printed
                                                                     else ""))
    LoopClosedNoise.route_to(log)
    return CheckpointUnreadable(step, path, f"{type(e).__name__}: {_short(e)}", log)

  def _log(self, step: int, detail: str) -> str:
    """Appends `detail` of step `step` to restore_errors.log (this process's); returns the log's path."""
    path = os.path.join(self._root, str(step))
    name = "restore_errors.log" if jax.process_index() == 0 else f"restore_errors.process{jax.process_index()}.log"
    entry = f"== {time.strftime('%Y-%m-%d %H:%M:%S')}: checkpoint step {step} at {path}\n" + detail
    for log in (os.path.join(self.directory, name), os.path.join(tempfile.gettempdir(), f"opdjax_{name}")):
      try:  # (a checkpoint folder we may not write to, e.g. one exported from: the temp folder)
        with open(log, "a") as f:
          f.write(entry)
        break
      except OSError:
        continue
    return log

  def wait(self) -> None:
    with ctrl_c_held(), self._writing("in flight"):
      self._latest.wait_until_finished()
    self._publish_best()

  def close(self) -> None:
    # The run is ending (normally or from a Ctrl-C already reported): a second Ctrl-C here must not
    # cut the last save short, and has nothing left to stop.
    with ctrl_c_held(reraise=False), self._writing("in flight"):
      self._latest.close()
    self._publish_best()


BEST_FILE = "BEST.json"  # {"metric", "mode", "step", "value"} of the step under checkpoints/best


def _read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def _short(e: Exception, limit: int = 200) -> str:
  """The cause on one line, without TensorStore's spec dumps (tens of lines of JSON that bury it)."""
  text = re.sub(r"\s*\[tensorstore_spec[^\]]*'\]", "", str(e))
  text = re.split(r"\s*See full TensorStore details", text)[0]
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit] + " ..."


def _dict_diff(a: dict, b: dict) -> str:
  keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  return ", ".join(f"{k}: {a.get(k)} in the checkpoint, {b.get(k)} now" for k in keys[:4])
