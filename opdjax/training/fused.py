"""The OPD loss from hidden states, fused and chunked: the student's logits gradient formed inside each
sequence chunk and contracted at once into the hidden-state and output-matrix gradients, so neither pass
holds more than `[B, chunk, V]` logits (docs/objectives.md, "Memory: the fused chunked loss"). The
per-token objectives themselves are opdjax.training.loss's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from opdjax.rollout.base import SamplingParams
from opdjax.training.loss import LossConfig, importance_weights, per_token_terms, processed_logprobs, served_terms


def _precision(dtype):
  """fp32 compute multiplies in fp32 on a GPU too (XLA's default there is TF32; `matmul_precision`)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _logits(h, w_DxV, dtype):
  return jnp.einsum("...d,dv->...v", h.astype(dtype), w_DxV.astype(dtype), preferred_element_type=jnp.float32,
                    precision=_precision(dtype))


def _chunks(x, chunk):
  """`[B, L, ...]` -> `[n, B, chunk, ...]`, zero-padded (padding carries zero mask)."""
  n = -(-x.shape[1] // chunk)
  x = jnp.pad(x, [(0, 0), (0, n * chunk - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)


def _unchunk(y, length):
  y = jnp.moveaxis(y, 0, 1)
  return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :length]


def _fused_forward(h_s, w_s, teacher: dict, w_t, targets, rollout_lp, mask, cfg: LossConfig, dtype, sampling):
  """Loss, its gradients w.r.t. (h_s, w_s), and per-token diagnostics, one chunk at a time.

  The student's logits gradient is formed inside each chunk and immediately contracted into
  the hidden-state and output-matrix gradients, so neither pass ever holds more than
  `[B, chunk, V]` logits and nothing (teacher or student projection) is recomputed backwards.
  The trainer's log-prob on the rollout's processed distribution comes from the same chunk of
  student logits.
  """
  b, length, _ = h_s.shape
  chunk = max(1, min(cfg.chunk, length))
  mask = mask.astype(jnp.float32)
  denom = jnp.maximum(jnp.sum(mask), 1.0)

  def body(g_w, xs):
    hs, t, tgt, rlp, m = xs
    ls = _logits(hs, w_s, dtype)
    if w_t is not None:  # the teacher's hidden states: its logits from its output matrix, chunk by chunk
      lt = _logits(t["hidden"], w_t, dtype)
      terms_fn = lambda ls: per_token_terms(ls, lt, tgt, cfg, m, rlp)  # noqa: E731
    else:  # a served teacher's answer (served_terms)
      terms_fn = lambda ls: served_terms(ls, t, tgt, cfg, m, rlp)  # noqa: E731
    term, vjp_fn, terms = jax.vjp(lambda ls: _term_and_aux(terms_fn(ls)), ls, has_aux=True)
    lp_s = terms.pop("trainer_logprobs")  # the objective's: the student at T = 1
    lp_tr = lp_s if sampling is None else processed_logprobs(ls, tgt, sampling)
    lp_tr = jnp.where(m > 0, lp_tr, 0.0)  # off the mask a removed target would be -inf
    w = importance_weights(lp_tr, rlp, cfg)
    coef = w * m / denom
    (g_logits,) = vjp_fn(coef)
    g_h = jnp.einsum("bcv,dv->bcd", g_logits.astype(dtype), w_s.astype(dtype), preferred_element_type=jnp.float32,
                     precision=_precision(dtype))
    g_w = g_w + jnp.einsum("bcd,bcv->dv", hs.astype(dtype), g_logits.astype(dtype),
                           preferred_element_type=jnp.float32, precision=_precision(dtype))
    terms = {**terms, "student_logprobs": lp_s, "trainer_logprobs": lp_tr, "is_weight": w}
    return g_w, (jnp.sum(coef * term), g_h, terms)

  xs = jax.tree.map(lambda x: _chunks(x, chunk), (h_s, teacher, targets, rollout_lp, mask))
  g_w, (losses, g_h, terms) = jax.lax.scan(body, jnp.zeros(w_s.shape, jnp.float32), xs)
  terms = jax.tree.map(lambda y: _unchunk(y, length), terms)
  return jnp.sum(losses), terms, (_unchunk(g_h, length).astype(h_s.dtype), g_w.astype(w_s.dtype))


def _term_and_aux(terms):
  term = terms.pop("term")
  return term, jax.lax.stop_gradient(terms)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def fused_opd_loss(h_s, w_s, h_t, w_t, targets, rollout_lp, mask, cfg: LossConfig, dtype,
                   sampling: SamplingParams | None = None):
  """Masked mean of `w * term` over tokens from hidden states, and per-token diagnostics.

  `h_s [B, L, D]`, `w_s [D, V]`: student (differentiated). `h_t`, `w_t`: teacher (constant).
  `sampling`: the engine's processing of `rollout_lp` (`sampling_transform`); None: none beyond T = 1.
  Returns `(loss, terms)` where `terms` holds `[B, L]` arrays: reverse_kl, entropy,
  student_logprobs and teacher_logprobs (the objective's, T = 1), trainer_logprobs (the student
  on `sampling`'s processed distribution, what `rollout_lp` is compared with; 0 off the mask, -inf
  where the processing removes the target), is_weight.
  """
  loss, terms, _ = _fused_forward(h_s, w_s, {"hidden": h_t}, w_t, targets, rollout_lp, mask, cfg, dtype, sampling)
  return loss, terms


def _fused_fwd(h_s, w_s, h_t, w_t, targets, rollout_lp, mask, cfg, dtype, sampling):
  loss, terms, grads = _fused_forward(h_s, w_s, {"hidden": h_t}, w_t, targets, rollout_lp, mask, cfg, dtype,
                                      sampling)
  return (loss, terms), grads


def _fused_bwd(cfg, dtype, sampling, grads, cotangents):
  g_loss = cotangents[0]  # the diagnostics carry no gradient
  g_h, g_w = grads
  # Cotangents keep the primals' dtypes (bf16 hidden states stay bf16).
  return ((g_loss * g_h).astype(g_h.dtype), (g_loss * g_w).astype(g_w.dtype), None, None, None, None, None)


fused_opd_loss.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def fused_served_loss(h_s, w_s, teacher: dict, targets, rollout_lp, mask, cfg: LossConfig, dtype,
                      sampling: SamplingParams | None = None):
  """`fused_opd_loss` with a served teacher: `teacher` holds its server's answer in the batch's
  `[B, L(, K)]` layout (`SERVED_KEYS`, opdjax.rollout.vllm.teacher) instead of hidden states and an
  output matrix; the objective is `served_terms`."""
  loss, terms, _ = _fused_forward(h_s, w_s, teacher, None, targets, rollout_lp, mask, cfg, dtype, sampling)
  return loss, terms


def _served_fwd(h_s, w_s, teacher, targets, rollout_lp, mask, cfg, dtype, sampling):
  loss, terms, grads = _fused_forward(h_s, w_s, teacher, None, targets, rollout_lp, mask, cfg, dtype, sampling)
  return (loss, terms), grads


def _served_bwd(cfg, dtype, sampling, grads, cotangents):
  g_loss = cotangents[0]
  g_h, g_w = grads
  return ((g_loss * g_h).astype(g_h.dtype), (g_loss * g_w).astype(g_w.dtype), None, None, None, None)


fused_served_loss.defvjp(_served_fwd, _served_bwd)
