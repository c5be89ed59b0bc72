"""The control hooks of the OPD loop: held-out evaluation, checkpoints, the non-finite policy, fault
injection (tests only), progress and the params history a warm-up keeps; and `assemble`, the run's hooks
in their one order (the guards are in opdjax.pipeline.guards, the writers in opdjax.pipeline.writers)."""

from __future__ import annotations

import math
import os
import signal
import sys
import time

from opdjax.pipeline.checkpoint import RunState
from opdjax.pipeline.guards import GuardHalt, WindowGuard, run_guards
from opdjax.pipeline.loop import Hook, Loop
from opdjax.pipeline.writers import run_writers
from opdjax.pipeline.writers.base import carried_eval_keys
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


class NonFiniteHalt(GuardHalt):
  pass


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
  `guards`: the run's guards, whose states (windows) the checkpoint keeps."""

  def __init__(self, checkpointer, every: int, guards=(), fault: FaultHook | None = None):
    self.ckpt, self.every, self.guards, self.fault = checkpointer, every, list(guards), fault

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
    run = RunState.of(loop, step, **{g.name: g.state() for g in self.guards})
    self.ckpt.save_run(run, metrics=loop.last_eval)

  def end(self, loop: Loop) -> None:
    self.ckpt.wait()  # a failed asynchronous save (e.g. a full disk) raises here

  def close(self, loop: Loop) -> None:
    self.ckpt.close()


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
    for g in loop.hooks:
      if isinstance(g, WindowGuard) and f"{g.name}_event" in rec:  # a guard acted: always a line of its own
        line = f"{self.desc}: step {rec['step']}: {g.name.replace('_', ' ')}: {rec[f'{g.name}_event']}"
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


def assemble(cfg, out_dir: str, checkpointer, resume_step: int, primary: bool, progress: bool,
             budget: float | None, guard_states: dict | None = None) -> list[Hook]:
  """The hooks of `opdjax train` in their one order. The guards come first: they annotate the record the
  writers write and may stop the run. The checkpoint comes last: it saves a step every other hook has
  finished, the guards' windows included (`guard_states`: theirs at the checkpoint resumed from). Process 0
  (`primary`) alone writes files and progress; every process checkpoints (Orbax)."""
  guards = run_guards(cfg, checkpointer, budget, guard_states)
  fault = FaultHook()
  hooks = [*guards, EvalHook(cfg.train.eval_every), fault, *run_writers(cfg, out_dir, resume_step, primary),
           NonFiniteHook(cfg.train.on_nonfinite, checkpointer)]
  if primary:
    hooks.append(Progress("OPD", progress))
  return hooks + [CheckpointHook(checkpointer, cfg.train.checkpoint_every, guards, fault)]
