"""Re-scoring: per-token fp32 log-probs of the same tokens under given params.

A rollout becomes a `TrainBatch` of next-token-prediction arrays of length
L = P + N - 1: `tokens[:, i]` predicts `targets[:, i]`, and `loss_mask` is 1
exactly where the target is a completion token. Everything is chunked over the
sequence so no `[B, L, V]` array is ever materialised.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from opdjax.models.decoder import Model
from opdjax.rollout.base import Rollout, model_inputs

TrainBatch = dict[str, jax.Array]


def batch_from_rollout(r: Rollout) -> TrainBatch:
  """The sequences as the models read them (`model_inputs`, the layout the engine's teacher scoring
  shares), the loss mask over completion targets and the engine's log-probs at those targets."""
  loss_mask = jnp.concatenate(
      [jnp.zeros_like(r.prompt_mask[:, 1:]), r.completion_mask], axis=1).astype(jnp.float32)
  rollout_lp = jnp.concatenate(
      [jnp.zeros(r.prompt_tokens[:, 1:].shape, jnp.float32), r.rollout_logprobs], axis=1)
  return {
      **model_inputs(r.prompt_tokens, r.prompt_mask, r.completion_tokens, r.completion_mask),
      "loss_mask": loss_mask,
      "rollout_logprobs": rollout_lp * loss_mask,
  }


def chunked_over_positions(fn: Callable, chunk: int, *arrays_BxL):
  """Maps `fn` over sequence chunks of `[B, L, ...]` arrays with rematerialisation.

  `fn(*chunks)` returns a pytree of `[B, C, ...]` arrays; the result is the same
  pytree at full length. Under `grad`, each chunk's logits are recomputed in the
  backward pass instead of stored, so memory holds O(B * chunk * V).
  """
  length = arrays_BxL[0].shape[1]
  chunk = max(1, min(chunk, length))
  n = -(-length // chunk)
  pad = n * chunk - length

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], n, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  def merge(y):
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], n * chunk, *y.shape[3:])[:, :length]

  body = jax.checkpoint(lambda xs: fn(*xs))
  out = jax.lax.map(body, tuple(split(a) for a in arrays_BxL))
  return jax.tree.map(merge, out)


def token_logprobs(model: Model, params, batch: TrainBatch, temperature: float = 1.0,
                   chunk: int = 256) -> jax.Array:
  """fp32 log-prob of each target `[B, L]` (0 where `loss_mask` is 0)."""
  h, _ = model.hidden(params, batch["tokens"], batch["positions"], batch["attention_mask"])

  def per_chunk(h_c, tgt_c):
    logits = model.logits(params, h_c)
    if temperature > 0:
      logits = logits / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tgt_c[..., None], axis=-1)[..., 0]

  lp = chunked_over_positions(per_chunk, chunk, h, batch["targets"])
  return lp * batch["loss_mask"]


def masked_mean(x, mask):
  """Token-level masked mean: sum(mask * x) / max(sum(mask), 1)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)
