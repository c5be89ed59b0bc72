"""The OPD loop: the one place a train step is called inside a step loop.

Each step: sample and prepare the objective's inputs (Sampler; AsyncSampler with
rollout.async_depth > 0, a producer thread running ahead) -> run the jitted step (objective) ->
record step t-1 only after step t is dispatched (no host sync in between). Everything else is a hook:
held-out evaluation, checkpoints, the non-finite policy, fault injection, progress, metric writers.
`opdjax train`, the calibration/admission sweeps, the mismatch warm-ups, the GRPO comparison and the
admission validation all run `run_loop`, so a budget is measured on the loop users train with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time

import jax
import numpy as np

from opdjax.errors import Interrupted, ServerFailed
from opdjax.pipeline.async_sampler import AsyncSampler
from opdjax.pipeline.overlap import fields as overlap_fields
from opdjax.pipeline.overlap import generate_side
from opdjax.pipeline.quiet import ctrl_c_held
from opdjax.pipeline.session import Session
from opdjax.pipeline.stages import Sample, Sampler, objective
from opdjax.training.step import TrainState
from opdjax.views.view import EngineView


class Hook:
  """Called by the loop; every method is optional.

  `start(loop)` before the first step, then `ready(loop)` once every hook has started;
  `after_step(loop, step)` once step `step`'s update is dispatched (loop.state holds it,
  loop.pending its not-yet-written record); `phase(loop, name, step)` after the rollout / the step
  of `step` (fault injection); `record(loop, rec)` when a step's record is final; `end(loop)` after
  the last record; `close(loop)` always, also on errors. A hook may set `loop.stop` (a reason) to
  end the run after the current step (the checkpoint hook saves it first).
  """

  def start(self, loop: Loop) -> None: ...
  def ready(self, loop: Loop) -> None: ...
  def after_step(self, loop: Loop, step: int) -> None: ...
  def phase(self, loop: Loop, name: str, step: int) -> None: ...
  def record(self, loop: Loop, rec: dict) -> None: ...
  def interrupted(self, loop: Loop, finished: int) -> None: ...
  def end(self, loop: Loop) -> None: ...
  def close(self, loop: Loop) -> None: ...


@dataclasses.dataclass
class Loop:
  session: Session
  view: EngineView
  seed: int
  steps: int
  state: TrainState
  sampler: Sampler | AsyncSampler
  hooks: list
  start_step: int = 0
  last_eval: dict | None = None
  records: list = dataclasses.field(default_factory=list)
  pending: tuple | None = None  # (record, device metrics, score thunk, timing) of the last dispatched step
  t0: float = dataclasses.field(default_factory=time.time)
  eval_s: float = 0.0  # seconds spent in held-out evaluation, left out of `wall_s`
  stop: str | None = None
  timed: bool = False
  sample: Sample | None = None  # the step just dispatched (opdjax.pipeline.writers.samples reads it)

  def flush(self) -> None:
    """Reads the pending step's metrics to the host and hands its record to every hook."""
    if self.pending is None:
      return
    rec, metrics, score, timing = self.pending
    self.pending = None
    rec.update(score())  # train_accuracy, teacher_mismatch_* (Sample.score)
    metrics = jax.device_get(metrics)  # one transfer for every metric
    rec.update({("train_reverse_kl" if k == "reverse_kl" else k): float(v) for k, v in metrics.items()})
    if self.last_eval is not None:
      for k, v in self.last_eval.items():
        rec.setdefault(k, v)  # held-out numbers of the latest evaluation
    rec["elapsed_s"] = round(time.time() - self.t0, 3)
    if timing is not None:
      rec.update(timing.fields(self.eval_s))
      rec["wall_s"] = round(rec["elapsed_s"] - self.eval_s, 3)
    self.emit(rec)

  def emit(self, rec: dict) -> None:
    self.records.append(rec)
    for h in self.hooks:
      h.record(self, rec)

  def evaluate(self, step: int, pause: bool = False) -> dict:
    """Held-out quality of the current params; its seconds are counted in `eval_s` (left out of
    `wall_s`), after the step in flight finished. `pause`: the producer waits meanwhile, so that
    time left out of the wall clock is time in which neither side works (time-to-quality
    comparisons); otherwise it keeps sampling (a real run's wall clock)."""
    with self.sampler.paused() if pause else contextlib.nullcontext():
      jax.block_until_ready(self.state)
      t = time.perf_counter()
      self.last_eval = {**self.session.evaluate(self.state.params, step), "eval_step": step}
      self.eval_s += time.perf_counter() - t
    return self.last_eval


class Timing:
  """A step's time split: the sampler's stages (Sample.stats) and the trainer's busy time, from
  receiving the rollout to the end of the step's hooks (or to the record's flush, if earlier),
  evaluation left out."""

  def __init__(self, sample: Sample, step: int, depth: int, eval_s: float):
    self.stats, self.step, self.depth = dict(sample.stats), step, depth
    self.versions = self.stats.pop("versions", None)
    self.tags = self.stats.pop("tags", {})  # which server sampled the rollout (vLLM)
    self.t0, self.eval0, self.t1, self.eval1 = time.perf_counter(), eval_s, None, None

  def end(self, eval_s: float) -> None:
    self.t1, self.eval1 = time.perf_counter(), eval_s

  def fields(self, eval_s: float) -> dict:
    t1, eval1 = (self.t1, self.eval1) if self.t1 is not None else (time.perf_counter(), eval_s)
    st = self.stats
    # Synchronous: the sampler first waits for the previous step's device work (it makes the params):
    # train time, counted in the record where it is measured.
    # Asynchronous: publishing the params (copy, export) and distributing the rollout are the trainer's.
    train = (t1 - self.t0 - (eval1 - self.eval0) + st.pop("time_step_wait_s", 0.0) + st.get("time_publish_s", 0.0)
             + st.get("time_distribute_s", 0.0))
    sampling = generate_side(st)
    if "time_queue_wait_s" in st:  # asynchronous: each side waits only for the other
      trainer_wait, producer_wait = st["time_queue_wait_s"], st.get("time_producer_wait_s", 0.0)
    else:  # synchronous: each side waits while the other works
      trainer_wait, producer_wait = sampling, train
    out = {k: round(v, 6) for k, v in st.items()}
    out.update({"time_train_s": round(train, 6), "async_depth": self.depth,
                "idle_trainer_frac": round(trainer_wait / max(trainer_wait + train, 1e-9), 4),
                "idle_producer_frac": round(producer_wait / max(producer_wait + sampling, 1e-9), 4)})
    if self.versions is not None:  # over the step's sequences (one version a rollout with both engines)
      out["params_lag_max"] = int(self.step - np.min(self.versions))
    out.update(self.tags)
    out.update(overlap_fields(out))  # overlap efficiency and busy fractions (opdjax.pipeline.overlap)
    return out


def run_loop(session: Session, *, view: EngineView | None = None, seed: int | None = None, steps: int | None = None,
             hooks=(), algo: str = "opd", state: TrainState | None = None, history=None, start: int = 0,
             last_eval: dict | None = None, async_depth: int = 0, async_mode: str = "exact", devices: str = "",
             timed: bool | None = None) -> Loop:
  """Runs steps `start`..`steps` of one run and returns the finished Loop (records, final state).

  Defaults come from the session's config: the rollout view, the seed, train.steps. A run from
  step 0 begins with a record of step 0 (held-out quality before training) when an EvalHook is
  present. `state`/`history`/`last_eval` resume a run (from a checkpoint). `async_depth` > 0: a
  producer thread samples ahead (`async_mode`, `devices`: see opdjax.pipeline.async_sampler).
  `timed`: records carry the time split (default: asynchronous runs only, as it blocks after each
  synchronous sampling stage).
  """
  cfg = session.cfg
  view = EngineView.parse(cfg.rollout.view) if view is None else view
  seed = cfg.seed if seed is None else seed
  steps = cfg.train.steps if steps is None else steps
  group = cfg.grpo.group_size if algo == "grpo" else 1
  obj = objective(session, algo)
  if state is None:  # the step donates its state: never the session's own params
    state = session.new_state(algo)
  if async_depth:
    trainer_device = next(iter(jax.tree.leaves(state.params)[0].devices()))
    if not session.placement.sharded:  # (a sharded state is placed already)
      # Committed like the inputs the producer sends: the step compiles once, not again at step 2.
      state = jax.device_put(state, trainer_device)
    sampler = AsyncSampler(session, view, seed, group, obj.prepare, depth=async_depth, mode=async_mode, steps=steps,
                           devices=devices, trainer_device=trainer_device)
  else:
    sampler = Sampler(session, view, seed, group, obj.prepare, timed=bool(timed))
  if history is not None and sampler.history is not None:
    for version, params in zip(history[0], history[1]):
      sampler.history.push(version, params)
  loop = Loop(session, view, seed, steps, state, sampler, list(hooks), start, last_eval,
              timed=sampler.timed if timed is None else timed)
  step = finished = start
  try:
    for h in loop.hooks:
      h.start(loop)
    for h in loop.hooks:
      h.ready(loop)
    for step in range(start, steps):
      sample = sampler(step, loop.state.params)
      timing = Timing(sample, step, sampler.depth, loop.eval_s) if loop.timed else None
      _phase(loop, "rollout", step + 1)
      with ctrl_c_held():  # the update and its record together: an interrupt lands after both or before both
        loop.state, metrics, score = obj(loop.state, sample)
        score, loop.sample = functools.partial(_scored, score, sample.rollout, session.task.eos_ids), sample
        _phase(loop, "step", step + 1)
        loop.flush()  # step t-1's record, after step t is dispatched
        version = sample.rollout.params_version
        rec = {"step": step + 1, "params_version": version, "params_lag": step - version, **sample.record}
        loop.pending = (rec, metrics, score, timing)
        finished = step + 1  # its update applied and its record composed: what an interrupt saves
      for h in loop.hooks:
        h.after_step(loop, step + 1)
      if timing is not None:
        timing.end(loop.eval_s)
      if loop.stop is not None:
        break
    loop.flush()
    for h in loop.hooks:
      h.end(loop)
  except KeyboardInterrupt as e:  # reported once the hooks below have closed (checkpoints written)
    if isinstance(e, Interrupted):
      raise
    _save_interrupted(loop, finished)
    raise Interrupted(finished + 1, finished=finished) from None  # the step it was in, or about to start
  except ServerFailed as e:  # a served teacher's server: the step it failed in, reported after the hooks closed
    raise ServerFailed(f"step {step + 1}: {e} The same command resumes from the last complete checkpoint.") from None
  finally:
    sampler.close()
    for h in loop.hooks:
      h.close(loop)
  return loop


def _save_interrupted(loop: Loop, finished: int) -> None:
  """Ctrl-C or SIGTERM: the hooks keep the last finished step (its record, a checkpoint). Skipped when the
  interrupt landed between the step's update and its record (the state is a step ahead of what was logged):
  the last checkpoint stands. A second interrupt while saving leaves it at that."""
  try:
    at = int(jax.device_get(loop.state.step))
    if at != finished:
      print(f"opdjax: not checkpointing on interrupt: the state is at step {at}, the last logged step {finished}",
            file=sys.stderr)
      return
    for h in loop.hooks:
      h.interrupted(loop, finished)
  except KeyboardInterrupt:
    pass


def _phase(loop: Loop, name: str, step: int) -> None:
  for h in loop.hooks:
    h.phase(loop, name, step)


def _scored(score, rollout, eos_ids) -> dict:
  """The step's score (Sample.score) with the completions' length and repetition fields (Rollout.lengths):
  read when the record is flushed, after the next step is dispatched, as the verifier's score is."""
  return {**score(), **rollout.lengths(eos_ids)}
