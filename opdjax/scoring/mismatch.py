"""Rollout/trainer mismatch on one scale.

Per completion token, r = log p_trainer(y) - log q_rollout(y): the same token, scored by the
trainer with its current params and by the engine that sampled it. With the mask m:

- `kl_k1`  = mean(-r): unbiased estimate of KL(rollout || trainer) (can be negative on a batch).
- `kl_k3`  = mean(e^r - r - 1): unbiased, always >= 0, lower variance (Schulman's k3).
  Both token-averaged (`*_tok`, every token weighs the same) and sequence-averaged (`*_seq`,
  mean over sequences of each sequence's token mean).
- `abs_r_mean`, `abs_r_max`: mean and max |r|.
- `prob_err_mult` = mean(e^|r|): the typical multiplicative error of a token's probability.
- `chi2_tok` = mean(e^(2r)) - 1 with r clamped to [-C, C]: chi-square divergence estimate, the
  variance of per-token importance weights; `chi2_seq`: the same for the sequence weights
  e^(sum_t r_t) (sums clamped).
- `ess_tok`, `ess_seq`: effective sample size fractions (sum w)^2 / (n sum w^2) of the importance
  weights w = e^r (1 = no mismatch).
- `prob_corr`: Pearson correlation of the two sides' token probabilities e^logp.
- `exact_kl`: the full-vocabulary KL(rollout || trainer) per position, averaged over tokens, when
  the rollout engine's distribution can be re-computed (the embedded engine's view: same weights
  perturbation, compute dtype and KV rounding). The k3 estimate converges to it (tested).
All token reductions are masked; every formula is in docs/mismatch.md too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opdjax.models.decoder import Model
from opdjax.rollout.base import SamplingParams
from opdjax.rollout.sampling import sampling_logprobs
from opdjax.scoring.rescore import TrainBatch, chunked_over_positions, masked_mean


def _seq_mean(x, mask):
  per_seq = jnp.sum(x * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
  has = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
  return jnp.sum(per_seq * has) / jnp.maximum(jnp.sum(has), 1.0)


def _ess(logw, valid):
  """(sum w)^2 / (n sum w^2), computed from log-weights, over `valid` entries."""
  logw = jnp.where(valid, logw, -jnp.inf)
  n = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
  return jnp.exp(2 * jax.nn.logsumexp(logw) - jax.nn.logsumexp(2 * logw)) / n


def sampled_metrics(rollout_logprobs, trainer_logprobs, mask, clamp: float = 20.0) -> dict[str, jax.Array]:
  """Mismatch metrics from the sampled tokens' log-probs on both sides (all `[B, N]`)."""
  mask = mask.astype(jnp.float32)
  valid = mask > 0
  r = jnp.where(valid, trainer_logprobs - rollout_logprobs, 0.0)
  rc = jnp.clip(r, -clamp, clamp)
  k1, k3 = -r, jnp.expm1(r) - r
  seq_r = jnp.clip(jnp.sum(r * mask, axis=-1), -clamp, clamp)
  has = jnp.sum(mask, axis=-1) > 0
  seq_w2 = jnp.where(has, jnp.exp(2 * seq_r), 0.0)
  p_roll, p_train = jnp.exp(rollout_logprobs), jnp.exp(trainer_logprobs)
  mu_a, mu_b = masked_mean(p_roll, mask), masked_mean(p_train, mask)
  cov = masked_mean((p_roll - mu_a) * (p_train - mu_b), mask)
  var_a, var_b = masked_mean(jnp.square(p_roll - mu_a), mask), masked_mean(jnp.square(p_train - mu_b), mask)
  return {
      "kl_k1_tok": masked_mean(k1, mask),
      "kl_k1_seq": _seq_mean(k1, mask),
      "kl_k3_tok": masked_mean(k3, mask),
      "kl_k3_seq": _seq_mean(k3, mask),
      "abs_r_mean": masked_mean(jnp.abs(r), mask),
      "abs_r_max": jnp.max(jnp.where(valid, jnp.abs(r), 0.0)),
      "prob_err_mult": masked_mean(jnp.exp(jnp.abs(rc)), mask),
      "chi2_tok": masked_mean(jnp.exp(2 * rc), mask) - 1.0,
      "chi2_seq": jnp.sum(seq_w2) / jnp.maximum(jnp.sum(has), 1) - 1.0,
      "ess_tok": _ess(rc, valid),
      "ess_seq": _ess(seq_r, has),
      "prob_corr": cov / jnp.sqrt(jnp.maximum(var_a * var_b, 1e-30)),
  }


def exact_kl(view: Model, view_params, trainer: Model, trainer_params, batch: TrainBatch,
             sampling: SamplingParams | None = None, chunk: int = 128) -> jax.Array:
  """Full-vocabulary KL(engine view || trainer) at every position `[B, L]` (0 off the mask).

  The engine side is the distribution it samples from (temperature, top-k, top-p applied); the
  trainer side is the trainer's model at the same temperature, the same as `token_logprobs`.
  """
  sampling = sampling or SamplingParams()
  args = (batch["tokens"], batch["positions"], batch["attention_mask"])
  h_v, _ = view.hidden(view_params, *args)
  h_t, _ = trainer.hidden(trainer_params, *args)
  temp = sampling.temperature if sampling.temperature > 0 else 1.0

  def per_chunk(hv, ht):
    shape = hv.shape[:-1]
    logq = sampling_logprobs(view.logits(view_params, hv).reshape(-1, view.cfg.logit_size), sampling)
    logp = jax.nn.log_softmax(trainer.logits(trainer_params, ht).reshape(logq.shape) / temp, axis=-1)
    q = jnp.exp(logq)
    kl = jnp.sum(jnp.where(q > 0, q * (logq - logp), 0.0), axis=-1)
    return kl.reshape(shape)

  return chunked_over_positions(per_chunk, chunk, h_v, h_t) * batch["loss_mask"]
