"""The stages of one OPD step: sample (engine, at the view's lag, noise and precision) -> prepare the
objective's inputs from the rollout alone (re-scoring batch, rewards) -> run the jitted train step
(the objective). The loop (opdjax.pipeline.loop) strings them together; asynchronous sampling
(opdjax.pipeline.async_sampler) replaces the sampler, nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from opdjax import seeds
from opdjax.errors import UserError
from opdjax.pipeline.session import Session
from opdjax.rollout import Rollout
from opdjax.scoring.rescore import batch_from_rollout
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView


@dataclasses.dataclass
class Sample:
  """Step t's rollout, ready for the objective. `inputs` are built from the rollout alone (no params),
  so a producer can build them off the trainer's critical path; `score()` gives the record's fields the
  rollout alone determines: the verifier's score of the completions (`train_accuracy`, absent without a
  verifier) and a served teacher's check (`teacher_mismatch_*`, on the steps teacher.check_every picks).
  `stats`: seconds spent in each sampling stage (timed samplers only). `record`: what the weight sync
  reports for the step's record, timed or not (`WeightUpdate.stats`: export and reload seconds,
  `sync_probe_max_abs`)."""

  rollout: Rollout
  refs: list
  inputs: object
  score: Callable[[], float | None]
  stats: dict = dataclasses.field(default_factory=dict)
  record: dict = dataclasses.field(default_factory=dict)


def check_group(batch: int, group: int) -> None:
  if batch % group:
    raise UserError(f"rollout.batch_size={batch} is not a multiple of grpo.group_size={group}.")


def step_prompts(session: Session, seed: int, step: int, batch: int, group: int) -> tuple[list, list]:
  """Step `step`'s prompts and references (the seed rule), each repeated `group` times (GRPO groups)."""
  prompts, refs = session.task.train_batch(seeds.rng(seed, step, "prompts"), batch // group)
  if group > 1:
    prompts = [p for p in prompts for _ in range(group)]
    refs = [r for r in refs for _ in range(group)]
  return prompts, refs


class Sampler:
  """Rollouts for step t from the params the view's engine holds: the trainer's params `lag` steps
  old, then noise and quantization; then the objective's `prepare`. `group` > 1 repeats each prompt
  (GRPO groups). Synchronous: it runs in the trainer's thread, between two train steps. `timed`:
  block after each stage to record its seconds (costs the overlap of generation with the
  previous step's device work)."""

  depth = 0
  mode = "sync"

  def __init__(self, session: Session, view: EngineView, seed: int, group: int = 1,
               prepare: Callable | None = None, timed: bool = False):
    self.session, self.seed, self.group, self.timed = session, seed, group, timed
    self.prepare = prepare or (lambda rollout, refs, step: (rollout, dict))
    check_group(session.cfg.rollout.batch_size, group)
    self.history = None
    self._set_view(view)

  def _set_view(self, view: EngineView) -> None:
    old = self.history
    self.view, self.engine = view, self.session.engines.get(view)
    self.history = ParamsHistory(view.lag + 1) if view.lag else None
    if old is not None and self.history is not None:  # keep the versions a larger lag still needs
      for v, p in zip(old.versions, old.params()):
        self.history.push(v, p)

  def __call__(self, step: int, params) -> Sample:
    s, clock = self.session, Clock(self.timed)
    clock.lap("time_step_wait_s", params)  # the previous train step's device time (it makes `params`)
    prompts, refs = step_prompts(s, self.seed, step, s.cfg.rollout.batch_size, self.group)
    version = step
    if self.history is not None:  # the history copies params (the step donates them)
      self.history.push(step, params)
      version, params = self.history.lagged(self.view.lag)
    engine_params = s.engine_params(self.engine, self.view, params, version, self.seed)
    update = self.engine.export(engine_params, version)
    self.engine.load(update)
    clock.lap("time_weight_sync_s", engine_params)
    rollout = self.engine.generate(prompts, s.sampling, seed=seeds.derive(self.seed, step, "sample"))
    clock.lap("time_generate_s", rollout)
    inputs, score = self.prepare(rollout, refs, step)
    clock.lap("time_prepare_s", inputs)
    return Sample(rollout, refs, inputs, score, clock.laps, sync_record(update.stats))

  def reconfigure(self, depth: int | None = None, view: EngineView | None = None) -> None:
    """The guard's backoff: a synchronous sampler can only change its view (from the next step)."""
    if depth:
      raise UserError("a synchronous sampler has no async depth to change.")
    if view is not None and view != self.view:
      self._set_view(view)

  def paused(self):
    return contextlib.nullcontext()  # nothing runs beside the trainer

  def close(self) -> None:
    pass


def sync_record(stats: dict) -> dict:
  """A weight sync's numbers as record fields (strings, e.g. a probe warning, stay as they are)."""
  return {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()}


class Clock:
  """Seconds per stage; blocks on each stage's output only when timing (a host sync otherwise avoided)."""

  def __init__(self, enabled: bool):
    self.enabled, self.laps, self.t = enabled, {}, time.perf_counter()

  def lap(self, name: str, output=None) -> None:
    if not self.enabled:
      return
    if output is not None:
      jax.block_until_ready(output)
    now = time.perf_counter()
    self.laps[name] = self.laps.get(name, 0.0) + now - self.t
    self.t = now


@jax.jit
def _batch(prompt_tokens, prompt_mask, completion_tokens, completion_mask, rollout_logprobs):
  """`batch_from_rollout` compiled (a dozen eager ops cost more host time than the step's rollout),
  on the arrays only: a Rollout's static fields (version, seed) would compile it again every step."""
  return batch_from_rollout(Rollout(prompt_tokens, prompt_mask, completion_tokens, completion_mask, rollout_logprobs))


def rescore_batch(rollout: Rollout):
  return _batch(rollout.prompt_tokens, rollout.prompt_mask, rollout.completion_tokens, rollout.completion_mask,
                rollout.rollout_logprobs)


class OpdObjective:
  """Re-score the rollout with student and teacher, one jitted step on the OPD loss, the teacher where the
  run places it (opdjax.pipeline.teacher): in the trainer, the step runs its layers; on the engine's side,
  the rollout brings the teacher's hidden states (ScoredRollout, from the engine's process) and the batch
  carries them (the step skips the teacher's layers); served, its servers score the rollout here, where it
  was sampled (the asynchronous producer's thread: scoring overlaps training), and the batch carries their
  answer."""

  def __init__(self, session: Session):
    self.session, self.step_fn = session, session.train_step("opd")
    self.teacher = session.teacher_side

  def prepare(self, rollout: Rollout, refs, step: int):
    """Step `step`'s (0-based) inputs: the re-scoring batch with the teacher's answer where its placement
    brings one (Teacher.answer), and the record fields the rollout alone determines."""
    batch, fields = self.teacher.answer(rescore_batch(rollout), rollout, refs, step)
    return batch, lambda: {**accuracy(self.session.task.score(refs, rollout.completions())), **fields}

  def __call__(self, state, sample: Sample):
    state, metrics = self.step_fn(state, self.session.teacher_params, sample.inputs)
    return state, metrics, sample.score


class GrpoObjective:
  """Verifier rewards, group-relative advantages, one jitted GRPO step (the baseline OPD is compared with)."""

  def __init__(self, session: Session):
    from opdjax.pipeline.teacher import refuse_placed_away
    from opdjax.training import grpo

    refuse_placed_away(session.cfg, "GRPO")  # (before the session's teacher: a GRPO config is refused as it is read)
    self.grpo, self.session, self.step_fn = grpo, session, session.train_step("grpo")

  def prepare(self, rollout: Rollout, refs, step: int):
    g = self.session.cfg.grpo
    r = self.grpo.verifier_rewards(self.session.task, refs, rollout.completions())
    adv = self.grpo.group_advantages(jnp.asarray(r), g.group_size, g.normalize_std)
    return (rescore_batch(rollout), adv), lambda: accuracy(float(r.mean()))

  def __call__(self, state, sample: Sample):
    batch, adv = sample.inputs
    state, metrics = self.step_fn(state, batch, adv)
    return state, metrics, sample.score


def accuracy(score: float | None) -> dict:
  """The verifier's score of a step's completions as its record's field (none without a verifier)."""
  return {} if score is None else {"train_accuracy": score}


def objective(session: Session, algo: str):
  return {"opd": OpdObjective, "grpo": GrpoObjective}[algo](session)
