"""Held-out evaluation: one compiled loss and one engine, shared by the loop and the sweeps."""

from __future__ import annotations

import functools

import jax

from opdjax import seeds
from opdjax.models import Model
from opdjax.rollout import Rollout, SamplingParams
from opdjax.rollout.deploy import jax_engine
from opdjax.scoring.rescore import batch_from_rollout
from opdjax.training.loss import LossConfig
from opdjax.training.step import opd_loss


class HeldOut:
  """Held-out quality of a student: reverse KL to the teacher on the student's own samples (full
  vocabulary), and the verifier's score of its greedy answers; one compiled loss and one engine. With a
  served teacher (`served`: a callable rollout -> its answer, opdjax.rollout.vllm.teacher) the reverse KL is
  the sampled-token estimate mean(log p_s(y) - log p_t(y)) on the same samples: unbiased for the same
  quantity, noisier (no full distribution comes back from a server)."""

  def __init__(self, student: Model, teacher: Model | None, task, sampling: SamplingParams, chunk: int, seed: int,
               engine_kw: dict, served=None):
    kind = "full_rkl" if served is None else "sampled_rkl"
    self.served = served
    self.loss = jax.jit(functools.partial(opd_loss, student=student, teacher=teacher,
                                          loss_cfg=LossConfig(kind=kind, chunk=chunk)))
    self.engine = jax_engine(student, **engine_kw)
    self.prompts, self.refs = task.eval_set()
    self.task, self.sampling, self.seed = task, sampling, seeds.derive(seed, 0, "eval")
    self.greedy = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=0.0)

  def __call__(self, params, teacher_params, version: int = 0) -> tuple[dict, Rollout]:
    """(metrics, the sampled held-out rollout)."""
    self.engine.sync(params, version)
    r = self.engine.generate(self.prompts, self.sampling, seed=self.seed)
    batch = batch_from_rollout(r)
    if self.served is not None:
      batch = {**batch, **self.served(r)}
    _, m = self.loss(params, teacher_params, batch)
    out = {"reverse_kl": float(m["reverse_kl"])}
    if self.task.has_verifier:  # (prompts without a verifier: no greedy pass to score)
      out["accuracy"] = self.task.score(self.refs, self.engine.generate(self.prompts, self.greedy, seed=0)
                                        .completions())
    return out, r


