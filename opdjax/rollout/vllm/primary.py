"""An engine that lives in process 0 only: vLLM sidecars behind a multi-process trainer.

The vLLM engine exports weights and talks HTTP to its servers from one process. Behind a trainer of
several processes, every process calls `export` and `distribute` at the same point of the same loop
(the trainer's thread: both are collectives), process 0 alone `load`s and `produce`s (no
collective: the asynchronous producer thread of process 0 may call them):
- `export` has every process write its own shards of the params into one folder for the servers
  (opdjax.rollout.vllm.weights; no gather), then a barrier;
- `load` has process 0's servers reload an export;
- `produce` has process 0 sample the whole batch (host arrays: tokens, mask, log-probs, version);
- `distribute` broadcasts them (a few integers and log-probs a token) to every process, and each
  process keeps only the rows its devices hold, as a global array (the padding of the prompts, a
  pure function of the prompts, is computed everywhere).
`sync` = load(export), `generate` = distribute(produce): the synchronous loop's calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from jax.experimental import multihost_utils

from opdjax.rollout.base import Capabilities, Rollout, RolloutEngine, SamplingParams, WeightUpdate, pad_prompts
from opdjax.rollout.vllm.exporter import shared_exporter


@dataclasses.dataclass
class Produced:
  """Process 0's sampled batch before it reaches the other processes (host arrays)."""

  tokens: np.ndarray  # [B, N] int32
  mask: np.ndarray  # [B, N] int32
  logprobs: np.ndarray  # [B, N] fp32
  version: int


class PrimaryEngine(RolloutEngine):
  def __init__(self, make: Callable[[], RolloutEngine], placement, capabilities: Capabilities, pad_id: int,
               version: int = 0):
    """`make()` builds the real engine, in process 0 only; `capabilities` are its (known to every process)."""
    self.placement, self.capabilities, self.pad_id, self._version = placement, capabilities, pad_id, version
    self.inner = make() if placement.primary else None
    # A vLLM engine's weights are written by every process, each its own shards (opdjax.rollout.vllm.weights):
    # process 0's exporter, rebuilt on the others (one broadcast), its folder checked to be shared.
    self.exporter = shared_exporter(self.inner.exporter if self.inner is not None else None)

  @property
  def params_version(self) -> int:
    return self._version

  def sync(self, params, version: int) -> None:
    self.load(self.export(params, version))

  def export(self, params, version: int) -> WeightUpdate:
    """Every process: a vLLM engine's folder written shard-wise by every process, then a barrier (no
    gather: no process holds the whole model); an engine that takes params (a JAX engine in process
    0) gets them gathered onto every host (a collective)."""
    if self.exporter is not None:
      return self.exporter.export(params, version)
    host = self.placement.host_tree(params)  # a collective: every process takes part
    return self.inner.export(host, version) if self.inner is not None else WeightUpdate(version)

  def load(self, update: WeightUpdate) -> None:
    if self.inner is not None:
      self.inner.load(update)
    self._version = update.version

  def release(self, update: WeightUpdate) -> None:
    if self.inner is not None:  # process 0 alone knows which folder its servers hold
      self.inner.release(update)

  def tags(self, version: int) -> dict:
    """Process 0: which server sampled how many prompts of the last batch at which version."""
    return self.inner.tags(version) if self.inner is not None else {}

  def produce(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int = 0) -> Produced:
    """Process 0 only, no collective: the whole batch sampled by its engine, as host arrays."""
    r = self.inner.generate(prompts, sampling, seed)
    return Produced(np.asarray(r.completion_tokens, np.int32), np.asarray(r.completion_mask, np.int32),
                    np.asarray(r.rollout_logprobs, np.float32), r.params_version)

  def distribute(self, produced: Produced | None, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seed: int = 0) -> Rollout:
    """Every process, the same point of the loop: process 0's `produced` (None elsewhere) broadcast;
    each process keeps its rows of one global rollout."""
    toks, mask = pad_prompts(prompts, self.pad_id)
    b, n = len(prompts), sampling.max_new_tokens
    if produced is not None:
      out = (produced.tokens, produced.mask, produced.logprobs, np.asarray([produced.version], np.int32))
    else:  # shapes only: the broadcast sends process 0's values
      out = (np.zeros((b, n), np.int32), np.zeros((b, n), np.int32), np.zeros((b, n), np.float32),
             np.zeros((1,), np.int32))
    tokens, cmask, lps, version = (np.asarray(x) for x in multihost_utils.broadcast_one_to_all(out))
    rows = self.placement.rows(b)
    arrays = [self.placement.batch(x[rows], b) for x in (toks, mask, tokens, cmask.astype(bool), lps)]
    self._version = int(version[0])
    return Rollout(*arrays, params_version=self._version, sampling=sampling, seed=seed)

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int = 0) -> Rollout:
    produced = self.produce(prompts, sampling, seed) if self.inner is not None else None
    return self.distribute(produced, prompts, sampling, seed)

  def close(self) -> None:
    if self.inner is not None:
      self.inner.close()
