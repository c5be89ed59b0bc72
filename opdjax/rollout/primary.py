"""An engine that lives in process 0 only: vLLM sidecars behind a multi-process trainer.

The vLLM engine exports weights and talks HTTP to its servers from one process. Behind a trainer of
several processes, every process calls `sync` and `generate` at the same point of the same loop:
`sync` gathers the (sharded) params onto every host, process 0 exports them to the servers;
`generate` has process 0 sample the whole batch, broadcasts the completions (a few integers and
log-probs a token) to every process, and each process keeps only the rows its devices hold, as a
global array (the padding of the prompts, a pure function of the prompts, is computed everywhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from jax.experimental import multihost_utils

from opdjax.rollout.base import Capabilities, Rollout, RolloutEngine, SamplingParams, WeightUpdate
from opdjax.rollout.jax_engine import pad_prompts


class PrimaryEngine(RolloutEngine):
  def __init__(self, make: Callable[[], RolloutEngine], placement, capabilities: Capabilities, pad_id: int,
               version: int = 0):
    """`make()` builds the real engine, in process 0 only; `capabilities` are its (known to every process)."""
    self.placement, self.capabilities, self.pad_id, self._version = placement, capabilities, pad_id, version
    self.inner = make() if placement.primary else None

  @property
  def params_version(self) -> int:
    return self._version

  def sync(self, params, version: int) -> None:
    self.load(self.export(params, version))

  def export(self, params, version: int) -> WeightUpdate:
    """Every process: the params gathered onto every host (a collective), exported by process 0."""
    host = self.placement.host_tree(params)  # a collective: every process takes part
    return self.inner.export(host, version) if self.inner is not None else WeightUpdate(version)

  def load(self, update: WeightUpdate) -> None:
    if self.inner is not None:
      self.inner.load(update)
    self._version = update.version

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int = 0) -> Rollout:
    toks, mask = pad_prompts(prompts, self.pad_id)
    b, n = len(prompts), sampling.max_new_tokens
    if self.inner is not None:
      r = self.inner.generate(prompts, sampling, seed)
      out = (np.asarray(r.completion_tokens, np.int32), np.asarray(r.completion_mask, np.int32),
             np.asarray(r.rollout_logprobs, np.float32))
    else:  # shapes only: the broadcast sends process 0's values
      out = (np.zeros((b, n), np.int32), np.zeros((b, n), np.int32), np.zeros((b, n), np.float32))
    tokens, cmask, lps = (np.asarray(x) for x in multihost_utils.broadcast_one_to_all(out))
    rows = self.placement.rows(b)
    arrays = [self.placement.batch(x[rows], b) for x in (toks, mask, tokens, cmask.astype(bool), lps)]
    return Rollout(*arrays, params_version=self._version, sampling=sampling, seed=seed)

  def close(self) -> None:
    if self.inner is not None:
      self.inner.close()
