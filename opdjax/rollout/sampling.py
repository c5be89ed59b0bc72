"""Logit processing shared by the engine's sampler and by re-scoring."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opdjax.rollout.base import SamplingParams


def sampling_logprobs(logits_BxV: jax.Array, sp: SamplingParams) -> jax.Array:
  """fp32 log-probs of the distribution the engine samples from.

  Temperature first, then top-k, then top-p (vLLM's order). Removed tokens get
  -inf. Greedy (`temperature == 0`) reports the unscaled model's log-probs.
  """
  logits = logits_BxV.astype(jnp.float32)
  if sp.temperature > 0:
    logits = logits / sp.temperature
    if sp.top_k > 0 and sp.top_k < logits.shape[-1]:
      kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sp.top_p < 1.0:
      sorted_desc = -jnp.sort(-logits, axis=-1)
      probs = jax.nn.softmax(sorted_desc, axis=-1)
      mass_before = jnp.cumsum(probs, axis=-1) - probs
      # Keep the smallest prefix whose mass reaches top_p (the first token always).
      keep = mass_before < sp.top_p
      cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
      logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.nn.log_softmax(logits, axis=-1)


def sample(logits_BxV: jax.Array, rng: jax.Array, sp: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """Returns (token [B] int32, its log-prob [B] fp32)."""
  logp = sampling_logprobs(logits_BxV, sp)
  if sp.temperature == 0:
    tok = jnp.argmax(logits_BxV, axis=-1)
  else:
    tok = jax.random.categorical(rng, logp, axis=-1)
  lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  return tok.astype(jnp.int32), lp
