"""The rollout interface shared by every engine (embedded JAX, its own-process sidecar, vLLM servers):
the engine protocol, the Rollout it returns and the Rollout's layout (prompt padding, the sequences
the models read), so no caller ever asks which engine it holds."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from opdjax.errors import UserError
from opdjax.models.decoder import positions_from_mask


class PromptTooLongError(UserError):
  pass


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
    toks, mask = to_host(self.completion_tokens), to_host(self.completion_mask)
    return [[int(t) for t, m in zip(row, mrow) if m] for row, mrow in zip(toks, mask)]

  def lengths(self, eos_ids) -> dict[str, float]:
    """The completions' length and repetition fields of a step's record (length_fields, repetition_fields)."""
    toks, mask = to_host(self.completion_tokens), to_host(self.completion_mask)
    return {**length_fields(toks, mask, self.sampling.max_new_tokens, eos_ids),
            **repetition_fields(toks, mask, eos_ids)}


def to_host(x):
  """The whole array on this host; rows other processes hold come through an all-gather (every
  process reads a sharded rollout's completions at the same point of the loop)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)
  return jax.device_get(x)


def length_fields(completion_tokens, completion_mask, max_new_tokens: int, eos_ids) -> dict[str, float]:
  """`completion_len_mean/max` (tokens, EOS included), `truncated_frac` (rows at max_new_tokens without
  EOS) and `eos_frac` (rows whose last token is an EOS) of one step's completions (host arrays)."""
  toks, mask = np.asarray(completion_tokens), np.asarray(completion_mask, bool)
  lengths = mask.sum(-1)
  last = np.take_along_axis(toks, np.maximum(lengths - 1, 0)[:, None], -1)[:, 0]
  eos = (lengths > 0) & np.isin(last, np.asarray(list(eos_ids) or [-1]))
  return {"completion_len_mean": float(lengths.mean()), "completion_len_max": int(lengths.max()),
          "truncated_frac": float(((lengths >= max_new_tokens) & ~eos).mean()), "eos_frac": float(eos.mean())}


def repetition_fields(completion_tokens, completion_mask, eos_ids) -> dict[str, float]:
  """How repetitive one step's completions are: `distinct_frac`, the share of distinct tokens among all the
  step's completion tokens (EOS included: a batch of 24 spaces a row or of bare EOS is 1 distinct token in
  all of them), and `repeat_ngram_frac`, the mean share of a row (EOS left out; rows under 2 tokens count 0)
  that its longest n-gram occurring twice covers (overlaps count: 24 spaces: 23/24)."""
  toks, mask = np.asarray(completion_tokens), np.asarray(completion_mask, bool)
  if not mask.any():
    return {}
  eos = np.asarray(list(eos_ids) or [-1])
  repeat = []
  for row, m in zip(toks, mask):
    t = row[m]
    t = t[~np.isin(t, eos)]
    repeat.append(_longest_repeat(t) / len(t) if len(t) >= 2 else 0.0)
  return {"distinct_frac": float(len(np.unique(toks[mask])) / mask.sum()), "repeat_ngram_frac": float(np.mean(repeat))}


def _longest_repeat(t: np.ndarray) -> int:
  """The length of the longest run of tokens that occurs at two positions (overlapping allowed): the
  longest run of equal tokens between `t` and `t` shifted by d, over every shift d."""
  best = 0
  for d in range(1, len(t) - best):
    eq = np.concatenate([[False], t[d:] == t[:-d], [False]])
    edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
    if len(edges):
      best = max(best, int((edges[1::2] - edges[::2]).max()))
  return best


@flax.struct.dataclass
class ScoredRollout(Rollout):
  """A rollout with the teacher's final hidden states on its sequences, `[B, L, D]` in the teacher's
  compute dtype, aligned with `model_inputs` (what `teacher.hidden` returns in the OPD step;
  rollout.teacher_scoring='engine', opdjax.rollout.jax.teacher)."""

  teacher_hidden: jax.Array | None = None


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, multiple: int = 8):
  """Left-pads to a length rounded up to `multiple` (bounds recompilation)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token.")
  p_len = -(-max(len(p) for p in prompts) // multiple) * multiple
  toks = np.full((len(prompts), p_len), pad_id, np.int32)
  mask = np.zeros((len(prompts), p_len), bool)
  for i, p in enumerate(prompts):
    toks[i, p_len - len(p):] = p
    mask[i, p_len - len(p):] = True
  return toks, mask


def model_inputs(prompt_tokens, prompt_mask, completion_tokens, completion_mask) -> dict[str, jax.Array]:
  """A rollout's sequences as the models read them, `[B, L = P + N - 1]`: `tokens[:, i]` predicts
  `targets[:, i]`; `positions` restart at 0 on each row's first real token. The one layout: the
  trainer's re-scoring batch (opdjax.scoring.rescore) and engine-side teacher scoring are built from
  it, so hidden states line up with the batch's tokens by construction (prompts left-padded,
  completions right-padded, the last token dropped: position i predicts token i + 1)."""
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
  return {
      "tokens": tokens[:, :-1],
      "positions": positions_from_mask(mask)[:, :-1],
      "attention_mask": mask[:, :-1],
      "targets": tokens[:, 1:],
  }


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

  What the asynchronous producer needs, with defaults for an engine that has nothing to say:
  `host_cpus` (the cores its host-side work belongs on), `tags(version)` (who sampled a rollout, for
  its record), `release(update)` (a version dropped unloaded: what its export holds goes), and the
  two halves of `generate` behind a multi-process trainer, `produce` (the sampling process, no
  collective) and `distribute` (every process, the same point of the loop).
  """

  capabilities: Capabilities
  # The export every trainer process writes its shards of (opdjax.rollout.vllm.exporter), which a
  # PrimaryEngine rebuilds on every process; None: the engine takes params.
  exporter: Any = None

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

  @property
  def host_cpus(self) -> list[int] | None:
    """The cores of an engine that runs on cores of its own (rollout.placement=disaggregated), where
    the producer's host work (loads, the objective's inputs) goes too; None: wherever the caller runs."""
    return None

  def tags(self, version: int) -> dict:
    """What a rollout's record says about who sampled it at `version` ({}: nothing beyond the version)."""
    return {}

  def release(self, update: WeightUpdate) -> None:  # noqa: B027 -- optional: most exports hold only arrays
    """A version dropped without the engine holding it: what its export holds outside Python goes."""

  def produce(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> Any:
    """The sampling side's half of `generate` (no collective); by default the rollout itself."""
    return self.generate(prompts, sampling, seed)

  def distribute(self, produced: Any, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seed: int) -> Rollout:
    """Every process, the same point of the loop: `produce`'s result as this process's rollout; by
    default `produced` as it is (an engine of one process)."""
    return produced

  def check_view(self, view) -> None:
    """One error naming the view fields this engine cannot realise."""
    unsupported = [f for f in ("compute_dtype", "kv_quant", "act_quant", "weights", "noise_sigma", "lag")
                   if getattr(view, f) != getattr(type(view)(), f) and f not in self.capabilities.view_parts]
    if unsupported:
      raise UserError(f"rollout.view={view}: the {type(self).__name__} cannot realise {', '.join(unsupported)};"
                      f" it realises {', '.join(sorted(self.capabilities.view_parts))}.")
