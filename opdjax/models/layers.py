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

from opdjax.errors import UserError
from opdjax.models import quant
from opdjax.models.config import ModelConfig


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x):
    w = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # Match HF: normalise in fp32, cast back, then scale by the weight.
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
  e = x_BxTxNxE.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
  ang_BxTxE2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(ang_BxTxE2)[:, :, None, :]
  sin = jnp.sin(ang_BxTxE2)[:, :, None, :]
  x = x_BxTxNxE.astype(jnp.float32)
  x1, x2 = x[..., : e // 2], x[..., e // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxE.dtype)


def kv_fake_quant(x_BxTxKxE: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Rounds keys/values through FP8 as a quantized KV cache stores them."""
  x = x_BxTxKxE.astype(jnp.float32)
  if cfg.kv_scale == "static":
    scale = jnp.ones((), jnp.float32)
  else:
    scale = quant.absmax_scale(x, cfg.kv_quant, axis=-1)
  q = quant.round_to_format(x / scale, cfg.kv_quant).astype(jnp.float32)
  return (q * scale).astype(x_BxTxKxE.dtype)


class Linear(nn.Module):
  """`y = x @ kernel (+ bias)`; with `act_quant`, x is first rounded per token (W8A8 engines). A
  packed fp8 kernel (`QArray`, kept packed only for `fp8_matmul` models) is multiplied on fp8."""

  features: int
  use_bias: bool
  dtype: Any
  act_quant: str = "none"

  @nn.compact
  def __call__(self, x):
    packed = self.get_variable("params", "kernel") if self.has_variable("params", "kernel") else None
    if isinstance(packed, quant.QArray):
      # Read as is: `self.param` would check q's shape against [in, out], and q may be [out, in].
      if self.act_quant != "fp8_e4m3":
        raise UserError("packed fp8 layer weights reach the decoder only in fp8_matmul models"
                        " (act_quant='fp8_e4m3'); dequantize them first (quant.unpack).")
      y = quant.fp8_dot(x, packed).astype(self.dtype)
    else:
      kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), jnp.float32)
      if self.act_quant != "none":
        x32 = x.astype(jnp.float32)
        scale = quant.absmax_scale(x32, self.act_quant, axis=-1)
        x = (quant.round_to_format(x32 / scale, self.act_quant).astype(jnp.float32) * scale).astype(x.dtype)
      y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(self.dtype)
    return y


def dense(features: int, bias: bool, name: str, cfg: ModelConfig, act_quant: bool = True) -> Linear:
  return Linear(features, bias, jnp.dtype(cfg.dtype), cfg.act_quant if act_quant else "none", name=name)

