"""The OPD loop: the one place a train step is called inside a step loop.

Each step: sample (Sampler) -> re-score into a batch and run the jitted step (objective) -> record
step t-1 only after step t is dispatched (no host sync in between). Everything else is a hook:
held-out evaluation, checkpoints, the non-finite policy, fault injection, progress, metric writers.
`opdjax train`, the calibration/admission sweeps, the mismatch warm-ups, the GRPO comparison and the
admission validation all run `run_loop`, so a budget is measured on the loop users train with.
"""

from __future__ import annotations

import dataclasses
import time

from opdjax.pipeline.session import Session
from opdjax.pipeline.stages import Sampler, objective
from opdjax.training.step import TrainState
from opdjax.views.view import EngineView


class Hook:
  """Called by the loop; every method is optional.

  `start(loop)` before the first step, then `ready(loop)` once every hook has started; `after_step(loop, step)` once step `step`'s update is
  dispatched (loop.state holds it, loop.pending its not-yet-written record); `phase(loop, name, step)`
  after the rollout / the step of `step` (fault injection); `record(loop, rec)` when a step's record
  is final; `end(loop)` after the last record; `close(loop)` always, also on errors.
  """

  def start(self, loop: Loop) -> None: ...
  def ready(self, loop: Loop) -> None: ...
  def after_step(self, loop: Loop, step: int) -> None: ...
  def phase(self, loop: Loop, name: str, step: int) -> None: ...
  def record(self, loop: Loop, rec: dict) -> None: ...
  def end(self, loop: Loop) -> None: ...
  def close(self, loop: Loop) -> None: ...


@dataclasses.dataclass
class Loop:
  session: Session
  view: EngineView
  seed: int
  steps: int
  state: TrainState
  sampler: Sampler
  hooks: list
  start_step: int = 0
  last_eval: dict | None = None
  records: list = dataclasses.field(default_factory=list)
  pending: tuple | None = None  # (record, device metrics, score thunk) of the last dispatched step
  t0: float = dataclasses.field(default_factory=time.time)

  def flush(self) -> None:
    """Reads the pending step's metrics to the host and hands its record to every hook."""
    if self.pending is None:
      return
    rec, metrics, score = self.pending
    self.pending = None
    s = score()
    if s is not None:
      rec["train_accuracy"] = s
    rec.update({("train_reverse_kl" if k == "reverse_kl" else k): float(v) for k, v in metrics.items()})
    if self.last_eval is not None:
      for k, v in self.last_eval.items():
        rec.setdefault(k, v)  # held-out numbers of the latest evaluation
    rec["elapsed_s"] = round(time.time() - self.t0, 3)
    self.emit(rec)

  def emit(self, rec: dict) -> None:
    self.records.append(rec)
    for h in self.hooks:
      h.record(self, rec)

  def evaluate(self, step: int) -> dict:
    self.last_eval = {**self.session.evaluate(self.state.params, step), "eval_step": step}
    return self.last_eval


def run_loop(session: Session, *, view: EngineView | None = None, seed: int | None = None, steps: int | None = None,
             hooks=(), algo: str = "opd", state: TrainState | None = None, history=None, start: int = 0,
             last_eval: dict | None = None) -> Loop:
  """Runs steps `start`..`steps` of one run and returns the finished Loop (records, final state).

  Defaults come from the session's config: the rollout view, the seed, train.steps. A run from
  step 0 begins with a record of step 0 (held-out quality before training) when an EvalHook is
  present. `state`/`history`/`last_eval` resume a run (from a checkpoint).
  """
  cfg = session.cfg
  view = EngineView.parse(cfg.rollout.view) if view is None else view
  seed = cfg.seed if seed is None else seed
  steps = cfg.train.steps if steps is None else steps
  group = cfg.grpo.group_size if algo == "grpo" else 1
  sampler = Sampler(session, view, seed, group)
  if history is not None and sampler.history is not None:
    for version, params in zip(history[0], history[1]):
      sampler.history.push(version, params)
  obj = objective(session, algo)
  if state is None:  # the step donates its state: never the session's own params
    state = session.new_state(algo)
  loop = Loop(session, view, seed, steps, state, sampler, list(hooks), start, last_eval)
  try:
    for h in loop.hooks:
      h.start(loop)
    for h in loop.hooks:
      h.ready(loop)
    for step in range(start, steps):
      rollout, refs = sampler(step, loop.state.params)
      _phase(loop, "rollout", step + 1)
      loop.state, metrics, score = obj(loop.state, rollout, refs)
      _phase(loop, "step", step + 1)
      loop.flush()  # step t-1's record, after step t is dispatched
      loop.pending = ({"step": step + 1, "params_version": rollout.params_version,
                       "params_lag": step - rollout.params_version}, metrics, score)
      for h in loop.hooks:
        h.after_step(loop, step + 1)
    loop.flush()
    for h in loop.hooks:
      h.end(loop)
  finally:
    for h in loop.hooks:
      h.close(loop)
  return loop


def _phase(loop: Loop, name: str, step: int) -> None:
  for h in loop.hooks:
    h.phase(loop, name, step)
