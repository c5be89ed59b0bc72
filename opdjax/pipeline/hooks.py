"""Hooks of the OPD loop: held-out evaluation, checkpoints, the non-finite policy, fault injection
(tests only), progress, metric writers (JSONL, TensorBoard) and the params history a warm-up keeps."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

from opdjax.errors import UserError
from opdjax.pipeline.checkpoint import RunState
from opdjax.pipeline.loop import Hook, Loop
from opdjax.views.history import ParamsHistory


class EvalHook(Hook):
  """Held-out quality at step 0 (a run from scratch), every `every` steps and at the last step.
  `pause`: an asynchronous producer waits during evaluation (see Loop.evaluate)."""

  def __init__(self, every: int, pause: bool = False):
    self.every, self.pause = max(1, every), pause

  def ready(self, loop: Loop) -> None:
    if loop.start_step == 0:
      loop.emit({"step": 0, **{k: v for k, v in loop.evaluate(0, self.pause).items() if k != "eval_step"}})

  def after_step(self, loop: Loop, step: int) -> None:
    if step % self.every == 0 or step == loop.steps:
      loop.pending[0].update(loop.evaluate(step, self.pause))


class NonFiniteHalt(UserError):
  def __init__(self, message: str, records: list[dict]):
    super().__init__(message)
    self.records = records


class NonFiniteHook(Hook):
  """train.on_nonfinite=halt: a non-finite loss stops the run (skip is compiled into the step)."""

  def __init__(self, policy: str, checkpointer=None):
    self.policy, self.ckpt = policy, checkpointer

  def record(self, loop: Loop, rec: dict) -> None:
    if self.policy == "halt" and "loss" in rec and not math.isfinite(rec["loss"]):
      where = ""
      if self.ckpt is not None:
        self.ckpt.wait()
        where = f" The last good checkpoint is step {self.ckpt.latest_step()} in {self.ckpt.directory}."
      raise NonFiniteHalt(f"non-finite loss at step {rec['step']}; halted.{where} Set train.on_nonfinite=skip to"
                          " skip such batches.", list(loop.records))


class FaultHook(Hook):
  """Tests only: OPDJAX_FAULT=phase@step SIGKILLs the process there (phase: rollout, step, save)."""

  def __init__(self):
    self.at = os.environ.get("OPDJAX_FAULT")

  def phase(self, loop: Loop, name: str, step: int) -> None:
    if self.at == f"{name}@{step}":
      os.kill(os.getpid(), signal.SIGKILL)


class CheckpointHook(Hook):
  """Orbax checkpoint of the whole run (a RunState) every `every` steps, at the end and when a hook
  stops the run (`loop.stop`); the step's record is on disk before the checkpoint that covers it.
  `guard`, `length_guard`: the run's mismatch and length guards, whose states the checkpoint keeps."""

  def __init__(self, checkpointer, every: int, guard=None, fault: FaultHook | None = None, length_guard=None,
               collapse_guard=None):
    self.ckpt, self.every, self.guard, self.fault, self.length_guard = checkpointer, every, guard, fault, length_guard
    self.collapse_guard = collapse_guard

  def after_step(self, loop: Loop, step: int) -> None:
    if (self.every and step % self.every == 0) or step == loop.steps or loop.stop is not None:
      self.after_step_save(loop, step)
      if self.fault is not None:
        self.fault.phase(loop, "save", step)

  def interrupted(self, loop: Loop, finished: int) -> None:
    """Ctrl-C or SIGTERM (SLURM's preemption): the last finished step is checkpointed before the run exits, so
    the same command loses no finished step."""
    if finished in self.ckpt.all_steps() or finished == loop.start_step:
      return
    self.after_step_save(loop, finished)
    self.ckpt.wait()

  def after_step_save(self, loop: Loop, step: int) -> None:
    loop.flush()
    run = RunState.of(loop, step, guard=None if self.guard is None else self.guard.state(),
                      length_guard=None if self.length_guard is None else self.length_guard.state(),
                      collapse_guard=None if self.collapse_guard is None else self.collapse_guard.state())
    self.ckpt.save_run(run, metrics=loop.last_eval)

  def end(self, loop: Loop) -> None:
    self.ckpt.wait()  # a failed asynchronous save (e.g. a full disk) raises here

  def close(self, loop: Loop) -> None:
    self.ckpt.close()


class JsonlWriter(Hook):
  """OUT/metrics.jsonl, one record per step. Resuming at step s keeps the records of steps <= s
  (a line cut by a crash is dropped), so every step is logged exactly once."""

  def __init__(self, path: str, resume_step: int | None):
    self.path, self.resume_step, self.file = path, resume_step, None

  def start(self, loop: Loop) -> None:
    if self.resume_step is not None:
      kept = []
      if os.path.exists(self.path):
        with open(self.path) as f:
          for line in f:
            try:
              rec = json.loads(line)
            except json.JSONDecodeError:
              break
            if rec["step"] > self.resume_step:
              break
            kept.append(rec)
      with open(self.path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
      os.replace(self.path + ".tmp", self.path)
    self.file = open(self.path, "a")

  def record(self, loop: Loop, rec: dict) -> None:
    self.file.write(json.dumps(rec) + "\n")
    self.file.flush()

  def close(self, loop: Loop) -> None:
    if self.file is not None:
      self.file.close()


def carried_eval_keys(loop: Loop, rec: dict) -> set[str]:
  """The held-out keys `rec` carries from an evaluation of an earlier step (metrics.jsonl keeps them,
  with `eval_step` saying when they were measured); plots and progress lines show a held-out value
  only at the step it was measured."""
  if "eval_step" not in rec or rec["eval_step"] == rec["step"]:
    return set()
  return set(loop.last_eval or {}) | {"eval_step"}


class TensorBoardWriter(Hook):
  """TensorBoard event files under `logdir` (tensorboardX): every numeric field of every record, by step."""

  def __init__(self, logdir: str):
    self.logdir, self.writer = logdir, None

  def start(self, loop: Loop) -> None:
    from tensorboardX import SummaryWriter

    self.writer = SummaryWriter(self.logdir, purge_step=loop.start_step + 1 if loop.start_step else None)

  def record(self, loop: Loop, rec: dict) -> None:
    stale = carried_eval_keys(loop, rec)
    for k, v in rec.items():
      if k != "step" and k not in stale and isinstance(v, (int, float)) and not isinstance(v, bool):
        self.writer.add_scalar(k, v, rec["step"])

  def close(self, loop: Loop) -> None:
    if self.writer is not None:
      self.writer.close()


class Progress(Hook):
  """A tqdm bar on a terminal; plain periodic lines (every `every_s` seconds and at the end) in logs."""

  def __init__(self, desc: str = "OPD", enabled: bool = True, every_s: float = 30.0, stream=None):
    self.desc, self.enabled, self.every_s = desc, enabled, every_s
    self.stream = stream or sys.stderr
    self.bar, self.last = None, 0.0

  def _postfix(self, loop: Loop, rec: dict) -> dict:
    if carried_eval_keys(loop, rec):  # not measured at this step: the training batch's numbers
      return {k: f"{rec[k]:.4f}" for k in ("loss", "train_reverse_kl") if k in rec}
    ev = loop.last_eval or {}
    short = {"teacher_nll": "nll", "teacher_f1": "f1"}  # (two teacher_ keys: k[:3] would merge them)
    return {short.get(k, k[:3]): f"{v:.4f}" for k, v in ev.items() if k != "eval_step"}

  def start(self, loop: Loop) -> None:
    if not self.enabled:
      return
    if self.stream.isatty():
      from tqdm import tqdm

      self.bar = tqdm(desc=self.desc, unit="step", initial=loop.start_step, total=loop.steps, file=self.stream,
                      leave=False)
    self.last = time.time()
    if loop.start_step == 0 and any(isinstance(h, EvalHook) for h in loop.hooks):
      self._line(f"step-0 eval on {len(loop.session.task.eval_set()[0])} held-out prompts (the engine compiles first)")
    else:
      self._line(f"sampling step {loop.start_step + 1} (the engine compiles first)")

  def phase(self, loop: Loop, name: str, step: int) -> None:
    if self.enabled and name == "rollout" and step == loop.start_step + 1:
      self._line(f"step {step}: compiling the train step (once)")

  def _line(self, text: str) -> None:
    if self.bar is not None:
      self.bar.write(f"opdjax: {text}", file=self.stream)
    else:
      print(f"opdjax: {text}", file=self.stream, flush=True)

  def record(self, loop: Loop, rec: dict) -> None:
    if not self.enabled or rec["step"] == loop.start_step:
      return
    for key, who in (("guard_event", "guard"), ("length_guard_event", "length guard"),
                      ("collapse_guard_event", "collapse guard")):
      if key in rec:  # a guard acted: always a line of its own
        line = f"{self.desc}: step {rec['step']}: {who}: {rec[key]}"
        if self.bar is not None:
          self.bar.write(line, file=self.stream)
        else:
          print(line, file=self.stream, flush=True)
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix(self._postfix(loop, rec))
    elif time.time() - self.last >= self.every_s or rec["step"] == loop.steps:
      self.last = time.time()
      fields = " ".join(f"{k}={v}" for k, v in self._postfix(loop, rec).items())
      print(f"{self.desc}: step {rec['step']}/{loop.steps} {fields}".rstrip(), file=self.stream, flush=True)

  def close(self, loop: Loop) -> None:
    if self.bar is not None:
      self.bar.close()


class HistoryHook(Hook):
  """Keeps the last `maxlen` params versions (version 0 = the start), for views with a lag."""

  def __init__(self, maxlen: int):
    self.history = ParamsHistory(maxlen)

  def start(self, loop: Loop) -> None:
    self.history.push(loop.start_step, loop.state.params)

  def after_step(self, loop: Loop, step: int) -> None:
    self.history.push(step, loop.state.params)
