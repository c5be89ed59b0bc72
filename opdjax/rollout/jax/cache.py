"""One JAX engine per engine-view model: views that differ only in the params they sync (weights,
noise, lag) share an engine and its compiled decode loop. The one engine cache of opdjax: the
pipeline's EnginePool and the analyses use it."""

from __future__ import annotations

from collections.abc import Sequence

from opdjax.errors import UserError
from opdjax.models.decoder import Model
from opdjax.rollout.jax.engine import JaxEngine
from opdjax.rollout.jax.sidecar import JaxSidecarEngine


class EngineCache:
  """`cores` (opdjax.rollout.cores.CoreSplit, rollout.placement=disaggregated): each engine in a process
  of its own on `cores.server` (opdjax.rollout.jax.sidecar), the trainer on `cores.trainer`. `teacher`
  ((Model, params), rollout.teacher_scoring='engine'): each of those processes also scores every
  rollout with the teacher (opdjax.rollout.jax.teacher); it needs `cores`."""

  def __init__(self, *, max_len: int, pad_id: int, eos_ids: Sequence[int], placement=None, cores=None, teacher=None):
    if teacher is not None and cores is None:
      raise UserError("rollout.teacher_scoring='engine' scores the teacher in the JAX engine's own process: set"
                      " rollout.placement=disaggregated, or rollout.teacher_scoring='trainer'.")
    self.max_len, self.pad_id, self.eos_ids, self.placement = max_len, pad_id, tuple(eos_ids), placement
    self.cores, self.teacher = cores, teacher
    self._engines: dict = {}

  def get(self, model: Model) -> JaxEngine | JaxSidecarEngine:
    if model.cfg not in self._engines:
      if self.cores is not None:
        self._engines[model.cfg] = JaxSidecarEngine(model.cfg, max_len=self.max_len, pad_id=self.pad_id,
                                                    eos_ids=self.eos_ids, cpus=self.cores.server,
                                                    trainer_cpus=self.cores.trainer, teacher=self.teacher)
      else:
        self._engines[model.cfg] = JaxEngine(model, None, max_len=self.max_len, pad_id=self.pad_id,
                                             eos_ids=self.eos_ids, placement=self.placement)
    return self._engines[model.cfg]

  def close(self) -> None:
    for e in self._engines.values():
      e.close()
    self._engines.clear()
