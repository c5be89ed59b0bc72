"""The stages of one OPD step: sample (engine, at the view's lag, noise and precision) -> re-score
into a batch and run the jitted train step (the objective). The loop (opdjax.pipeline.loop) strings
them together; asynchronous sampling replaces the sampler, nothing else.
"""

from __future__ import annotations

import jax.numpy as jnp

from opdjax import seeds
from opdjax.errors import UserError
from opdjax.pipeline.session import Session
from opdjax.rollout import Rollout
from opdjax.scoring.rescore import batch_from_rollout
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView


class Sampler:
  """Rollouts for step t from the params the view's engine holds: the trainer's params `lag` steps
  old, then noise and quantization. `group` > 1 repeats each prompt (GRPO groups)."""

  def __init__(self, session: Session, view: EngineView, seed: int, group: int = 1):
    batch = session.cfg.rollout.batch_size
    if batch % group:
      raise UserError(f"rollout.batch_size={batch} is not a multiple of grpo.group_size={group}.")
    self.session, self.view, self.seed, self.group = session, view, seed, group
    self.engine = session.engines.get(view)
    self.prompts_per_step = batch // group
    self.history = ParamsHistory(view.lag + 1) if view.lag else None

  def __call__(self, step: int, params) -> tuple[Rollout, list]:
    s = self.session
    prompts, refs = s.task.train_batch(seeds.rng(self.seed, step, "prompts"), self.prompts_per_step)
    if self.group > 1:
      prompts = [p for p in prompts for _ in range(self.group)]
      refs = [r for r in refs for _ in range(self.group)]
    version = step
    if self.history is not None:  # the history copies params (the step donates them)
      self.history.push(step, params)
      version, params = self.history.lagged(self.view.lag)
    self.engine.sync(s.engine_params(self.engine, self.view, params, version, self.seed), version)
    return self.engine.generate(prompts, s.sampling, seed=seeds.derive(self.seed, step, "sample")), refs


class OpdObjective:
  """Re-score the rollout with student and teacher, one jitted step on the OPD loss."""

  def __init__(self, session: Session):
    self.session, self.step_fn = session, session.train_step("opd")

  def __call__(self, state, rollout: Rollout, refs):
    state, metrics = self.step_fn(state, self.session.teacher_params, batch_from_rollout(rollout))
    return state, metrics, lambda: self.session.task.score(refs, rollout.completions())


class GrpoObjective:
  """Verifier rewards, group-relative advantages, one jitted GRPO step (the baseline OPD is compared with)."""

  def __init__(self, session: Session):
    from opdjax.training import grpo

    self.grpo, self.session, self.step_fn = grpo, session, session.train_step("grpo")

  def __call__(self, state, rollout: Rollout, refs):
    g = self.session.cfg.grpo
    r = self.grpo.verifier_rewards(self.session.task, refs, rollout.completions())
    adv = self.grpo.group_advantages(jnp.asarray(r), g.group_size, g.normalize_std)
    state, metrics = self.step_fn(state, batch_from_rollout(rollout), adv)
    return state, metrics, lambda: float(r.mean())


def objective(session: Session, algo: str):
  return {"opd": OpdObjective, "grpo": GrpoObjective}[algo](session)
