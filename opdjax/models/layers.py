"""The decoder's building blocks: RMSNorm, rotary embedding, the projection (`Linear`, optionally
on quantized activations or packed fp8 weights) and the FP8 rounding a quantized KV cache applies.

`Attention` (`opdjax.models.attention`) and the layer stack (`opdjax.models.decoder`) build on these.
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from opdjax.models import quant
from opdjax.models.config import ModelConfig


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x):
    return rms_norm(x, self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32), self.eps)


def rms_norm(x, w, eps: float):
  """RMSNorm over the last axis as HF computes it: normalise in fp32, cast back, then scale by the
  weight (the one implementation: the Flax layer and the engine's decode layers call it)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return w.astype(x.dtype) * y.astype(x.dtype)


def matmul_precision(dtype):
  """fp32 compute means fp32 matmuls: on a GPU, XLA's DEFAULT precision runs fp32 dots as TF32
  (a 10-bit mantissa), against tolerances measured on CPU (the fp32 reload probe's 1e-3, fp32
  re-scoring and parity checks). A context for tracing; nothing changes for bf16 / fp16 compute."""
  if jnp.dtype(dtype) == jnp.float32:
    return jax.default_matmul_precision("highest")
  return contextlib.nullcontext()


def rope(x_BxTxNxE: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in HF's rotate-half layout, computed in fp32."""
  return apply_rope(x_BxTxNxE, *rope_tables(positions_BxT, x_BxTxNxE.shape[-1], theta))


def rope_tables(positions_BxT: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """`(cos, sin)` `[B, T, 1, E/2]` fp32 for `apply_rope`: computed once per step, shared by every layer."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  ang_BxTxE2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(ang_BxTxE2)[:, :, None, :], jnp.sin(ang_BxTxE2)[:, :, None, :]


def apply_rope(x_BxTxNxE: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  e = x_BxTxNxE.shape[-1]
  x = x_BxTxNxE.astype(jnp.float32)
  x1, x2 = x[..., : e // 2], x[..., e // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxE.dtype)


def kv_quantize(x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array | None]:
  """`(q, scale)`: keys or values rounded through `cfg.kv_quant` as a quantized KV cache stores them,
  `scale` `[..., 1]` one per token and kv head (absmax over head_dim; None for `kv_scale=static`,
  scale 1). The engine's fp8 cache stores exactly these; `kv_fake_quant` (the views' re-scoring)
  reads them back through `kv_dequantize`, so both round alike by construction."""
  x32 = x.astype(jnp.float32)
  if cfg.kv_scale == "static":
    return quant.round_to_format(x32, cfg.kv_quant), None
  scale = quant.absmax_scale(x32, cfg.kv_quant, axis=-1)
  return quant.round_to_format(x32 / scale, cfg.kv_quant), scale


def kv_dequantize(q: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
  x = q.astype(jnp.float32)
  return (x if scale is None else x * scale).astype(dtype)


def kv_fake_quant(x_BxTxKxE: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Rounds keys/values through FP8 as a quantized KV cache stores them."""
  return kv_dequantize(*kv_quantize(x_BxTxKxE, cfg), x_BxTxKxE.dtype)


class Linear(nn.Module):
  """`y = x @ kernel (+ bias)`; with `act_quant`, x is first rounded per token (W8A8 numerics). Packed
  fp8 weights never reach it: an engine multiplies them itself (opdjax.models.inference)."""

  features: int
  use_bias: bool
  dtype: Any
  act_quant: str = "none"

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), jnp.float32)
    x = quantize_activations(x, self.act_quant)
    y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(self.dtype)
    return y


def quantize_activations(x, fmt: str):
  """Projection inputs rounded per token through `fmt` (W8A8 engines; `none`: `x` as it is)."""
  if fmt == "none":
    return x
  x32 = x.astype(jnp.float32)
  scale = quant.absmax_scale(x32, fmt, axis=-1)
  return (quant.round_to_format(x32 / scale, fmt).astype(jnp.float32) * scale).astype(x.dtype)


def dense(features: int, bias: bool, name: str, cfg: ModelConfig, act_quant: bool = True) -> Linear:
  return Linear(features, bias, jnp.dtype(cfg.dtype), cfg.act_quant if act_quant else "none", name=name)

