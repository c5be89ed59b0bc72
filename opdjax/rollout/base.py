"""The rollout interface shared by every engine (embedded JAX, vLLM sidecar)."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from opdjax.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings, named as in vLLM. `temperature=0` is greedy."""

  max_new_tokens: int = 32
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0 = off

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
    if self.temperature < 0:
      raise UserError(f"temperature must be >= 0, got {self.temperature}.")
    if not 0.0 < self.top_p <= 1.0:
      raise UserError(f"top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k < 0:
      raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")


@flax.struct.dataclass
class Rollout:
  """Prompts (left-padded) and sampled completions (right-padded).

  `rollout_logprobs[b, j]` is the log-prob of `completion_tokens[b, j]` under the
  distribution the engine sampled from (temperature, top-k and top-p applied;
  for greedy decoding, the unscaled model). Zero where `completion_mask` is 0.
  """

  prompt_tokens: jax.Array  # [B, P] int32
  prompt_mask: jax.Array  # [B, P] bool
  completion_tokens: jax.Array  # [B, N] int32
  completion_mask: jax.Array  # [B, N] bool, covers the EOS token when one was sampled
  rollout_logprobs: jax.Array  # [B, N] fp32
  params_version: int = flax.struct.field(pytree_node=False, default=0)
  sampling: SamplingParams = flax.struct.field(pytree_node=False, default=SamplingParams())
  seed: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def num_tokens(self) -> int:
    return int(jnp.sum(self.completion_mask))

  def completions(self) -> list[list[int]]:
    toks, mask = _host(self.completion_tokens), _host(self.completion_mask)
    return [[int(t) for t, m in zip(row, mrow) if m] for row, mrow in zip(toks, mask)]


def _host(x):
  """The whole array on this host; rows other processes hold come through an all-gather (every
  process reads a sharded rollout's completions at the same point of the loop)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)
  return jax.device_get(x)


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What an engine can do, so the pipeline never asks which engine it holds.

  `view_parts`: the `EngineView` fields it can honour. `compute_dtype`, `kv_quant` and `act_quant`
  are realised by the engine itself; `weights`, `noise_sigma` and `lag` by the params it is synced
  with. `packed_weights`: it takes FP8/INT8 matrices packed (`QArray` leaves) and dequantizes or
  multiplies them itself; otherwise it gets them fake-quantized in fp32.
  `processed_logprobs`: its `rollout_logprobs` are of the processed sampling distribution
  (temperature, top-k, top-p applied), the distribution the tokens were drawn from.
  """

  view_parts: frozenset[str]
  packed_weights: bool = False
  processed_logprobs: bool = True


@dataclasses.dataclass
class WeightUpdate:
  """A params version as `RolloutEngine.export` made it ready for `load`: host-side data and device
  arrays only, so loading it needs no collective. `params`: a pytree the engine installs (the JAX
  engine); `path`: a weights folder its servers reload (vLLM); `stats`: the export's time split
  (`time_export_s`, bytes written, ...) and what `load` adds (`time_reload_s`, `sync_probe_max_abs`),
  for the step's record; `probe`: the trainer's log-probs of the engine's probe under these params,
  which `load` compares with each server's (opdjax.rollout.vllm.probe)."""

  version: int
  params: Any = None
  path: str | None = None
  stats: dict = dataclasses.field(default_factory=dict)
  probe: Any = None


class RolloutEngine(abc.ABC):
  """Samples completions of token-id prompts with the params it was last synced with.

  Protocol: `sync(params, version)` installs weights (`version` is recorded in every later
  rollout), `generate(prompts, sampling, seed) -> Rollout`, `close()` releases what it holds
  (servers, caches); `capabilities` says what it can realise.

  Weight sync in two halves, for runs whose trainer and sampler are different threads or
  processes: `export(params, version)` is called by every trainer process at the same point of the
  loop, on the trainer's thread (it may run collectives and write files); `load(update)` by whoever
  samples (the producer thread; process 0 behind a multi-process trainer) and runs no collective.
  `sync` is the two in a row. An engine that has no export step inherits both.
  """

  capabilities: Capabilities

  @abc.abstractmethod
  def sync(self, params, version: int) -> None:
    """Installs new weights; `version` is recorded in later rollouts."""

  def export(self, params, version: int) -> WeightUpdate:
    """`params` made ready for `load` (every trainer process calls it, on the trainer's thread)."""
    return WeightUpdate(version, params=params)

  def load(self, update: WeightUpdate) -> None:
    """Installs an exported version; no collective (the sampling side calls it)."""
    self.sync(update.params, update.version)

  @abc.abstractmethod
  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> Rollout:
    ...

  @property
  @abc.abstractmethod
  def params_version(self) -> int:
    ...

  def close(self) -> None:  # noqa: B027 -- optional: most engines hold only Python objects
    """Releases what the engine holds (a server it started, caches)."""

  def check_view(self, view) -> None:
    """One error naming the view fields this engine cannot realise."""
    unsupported = [f for f in ("compute_dtype", "kv_quant", "act_quant", "weights", "noise_sigma", "lag")
                   if getattr(view, f) != getattr(type(view)(), f) and f not in self.capabilities.view_parts]
    if unsupported:
      raise UserError(f"rollout.view={view}: the {type(self).__name__} cannot realise {', '.join(unsupported)};"
                      f" it realises {', '.join(sorted(self.capabilities.view_parts))}.")
