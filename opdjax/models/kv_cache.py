"""The engine's KV cache and the attention that reads it.

Layout: `{"index": i32, "layers": (one dict per layer)}`, each layer `{"k", "v": [B, K, S, E]}` (an
fp8 cache, `kv_quant`, holds the fp8 bits as uint8) plus, for an fp8 cache with per-token scales
(`kv_scale=per_head`), `{"k_scale", "v_scale": [B, K, S]}` fp32. One buffer per layer, so a step
never slices a layer out of a stack; head-major, so one kv head's slots are contiguous `[S, E]` rows
a dot reads where they lie. Prompts
are left-padded, so every row writes the same slot (`index`) at each step: one in-place
`dynamic_update_slice` per buffer, on a cache the engine donates and gets back aliased.

Row b's filled slots are `[start_b, index]` after a step wrote slot `index`; `attention` attends over
exactly those. `decode_attention` (one query row) is the one entry point a decode step calls,
dispatched by platform (`lax.platform_dependent`, so one multi-platform export carries every
branch): on CUDA a Pallas kernel that reads only the filled slots (opdjax.models.decode_kernel, where
the cache's shape fits it), elsewhere the XLA reference, which reads the whole buffer under a mask.
Both read an fp8 cache as a plain convert of its stored bits and put the per-token scales on the
scores (k_scale) and the probabilities (v_scale): no scaled, widened copy of the cache is formed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from opdjax.models import attention as training_attention
from opdjax.models import decode_kernel, quant
from opdjax.models.config import ModelConfig
from opdjax.models.layers import kv_dequantize, kv_fake_quant, kv_quantize

_NEG_INF = -1e30


def quantized(cfg: ModelConfig) -> bool:
  return cfg.kv_quant != "none"


def scaled(cfg: ModelConfig) -> bool:
  """Whether an fp8 cache keeps a scale per token and kv head beside its values."""
  return quantized(cfg) and cfg.kv_scale == "per_head"


def storage_dtype(cfg: ModelConfig, dtype=None):
  """A quantized cache holds its fp8 values' bits as uint8 (as vLLM's fp8 cache does): a byte
  buffer every backend writes in place, where XLA:CPU rewrites an fp8 update through f16 and copies
  the buffer. Otherwise `dtype` or the compute dtype."""
  if quantized(cfg):
    return jnp.dtype(jnp.uint8)
  return jnp.dtype(dtype or cfg.dtype)


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype=None) -> dict:
  """An empty cache of `slots` slots per row."""
  shape = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
  dt = storage_dtype(cfg, dtype)

  def layer():
    out = {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}
    if scaled(cfg):
      out.update(k_scale=jnp.zeros(shape[:3], jnp.float32), v_scale=jnp.zeros(shape[:3], jnp.float32))
    return out

  return {"index": jnp.zeros((), jnp.int32), "layers": tuple(layer() for _ in range(cfg.num_layers))}


def write(layer: dict, k_BxTxKxE, v_BxTxKxE, index, cfg: ModelConfig, clear_tail: bool = False) -> dict:
  """`layer` with T new keys and values at slots `[index, index + T)`, rounded as the cache stores
  them (fp8: `kv_quantize`, exactly the rounding the `kv` view simulates). `clear_tail` (a prefill at
  slot 0): the slots after the new ones are zeroed in the same in-place write, so a value a diverged
  earlier call left there (NaN) never meets the zero weight a masked slot gets (0 * NaN is NaN)."""
  slots = layer["k"].shape[2]
  out = {}
  for name, x in (("k", k_BxTxKxE), ("v", v_BxTxKxE)):
    x = jnp.swapaxes(x, 1, 2)  # [B, K, T, E]: the new tokens only
    if quantized(cfg):
      x, scale = kv_quantize(x, cfg)
      if scale is not None:
        out[f"{name}_scale"] = scale[..., 0]
      x = jax.lax.bitcast_convert_type(x, jnp.uint8)
    out[name] = x.astype(layer[name].dtype)
  new = {}
  for name, x in out.items():
    if clear_tail:
      x = jnp.pad(x, [(0, 0), (0, 0), (0, slots - x.shape[2])] + [(0, 0)] * (x.ndim - 3))
      new[name] = jax.lax.dynamic_update_slice(layer[name], x, (0,) * x.ndim)
    else:
      new[name] = jax.lax.dynamic_update_slice(layer[name], x, (0, 0, index) + (0,) * (x.ndim - 3))
  return new


def read(layer: dict, name: str, dtype, cfg: ModelConfig) -> jax.Array:
  """Keys or values `[B, K, S, E]` in `dtype`, dequantized as the `kv` view rounds them."""
  x, scale = layer[name], layer.get(f"{name}_scale")
  if quantized(cfg):
    x = jax.lax.bitcast_convert_type(x, quant.FP8_DTYPES[cfg.kv_quant])
  elif x.dtype == jnp.dtype(dtype):
    return x
  return kv_dequantize(x, None if scale is None else scale[..., None], dtype)


def operand(layer: dict, name: str, dtype, cfg: ModelConfig) -> jax.Array:
  """Keys or values `[B, K, S, E]` as an attention dot's operand: a plain convert of what is stored (an
  fp8 cache's bits as fp8, unscaled; `attention_reference` applies the scales to scores and
  probabilities), which XLA can fuse into the dot instead of writing a widened cache."""
  x = layer[name]
  if quantized(cfg):
    x = jax.lax.bitcast_convert_type(x, quant.FP8_DTYPES[cfg.kv_quant])
  return x.astype(dtype)


def attention_reference(q_BxTxKxGxE, layer: dict, start_B, index, dtype, cfg: ModelConfig) -> jax.Array:
  """T queries at slots `[index, index + T)` against the cache (already holding their own keys):
  query t of row b attends over slots `[start_b, index + t]`. XLA dots over the whole buffer under
  that mask; fp32 scores and softmax; returns `[B, T, K, G, E]` in `dtype`. A query without a slot
  (a padded position before its row's start) gets zeros. An fp8 cache's per-token scales multiply
  the scores (k_scale: q·(s k) = s (q·k)) and the normalised probabilities (v_scale: Σ p (s v) = Σ (p s) v)."""
  b, t, k, g, e = q_BxTxKxGxE.shape
  keys, values = operand(layer, "k", dtype, cfg), operand(layer, "v", dtype, cfg)
  k_scale, v_scale = (layer.get(n) for n in ("k_scale", "v_scale"))
  slot = jnp.arange(keys.shape[2])
  last = index + jnp.arange(t)
  valid_BxTxS = (slot[None, None, :] >= start_B[:, None, None]) & (slot[None, None, :] <= last[None, :, None])
  valid = valid_BxTxS[:, None, None]  # [B, 1, 1, T, S]
  s = jnp.einsum("btkge,bkse->bkgts", q_BxTxKxGxE, keys, preferred_element_type=jnp.float32) * (e ** -0.5)
  if k_scale is not None:
    s = s * k_scale[:, :, None, None, :]
  s = jnp.where(valid, s, _NEG_INF)
  p = jnp.where(valid, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
  norm = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(norm > 0, norm, 1.0)
  if v_scale is not None:
    p = p * v_scale[:, :, None, None, :]
  # Normalised, then multiplied by the values in `dtype`, as jax.nn.dot_product_attention's XLA path
  # does (and XLA:CPU cannot run a bf16 x bf16 -> f32 dot its fusion passes leave unfused).
  return jnp.einsum("bkgts,bkse->btkge", p.astype(dtype), values)


def decode_attention(q_BxKxGxE, layer: dict, start_B, index, dtype, cfg: ModelConfig) -> jax.Array:
  """One query per row at slot `index` (its key already written): `[B, K, G, E]`. The platform
  dispatch point (module docstring)."""
  def reference(q, layer, start, index):
    return attention_reference(q[:, None], layer, start, index, dtype, cfg)[:, 0]

  cuda = reference
  if decode_kernel.fits(layer["k"].shape[2], cfg.head_dim):
    fp8 = quant.FP8_DTYPES[cfg.kv_quant] if quantized(cfg) else None
    cuda = lambda q, layer, start, index: decode_kernel.decode_attention(q, layer, start, index, dtype, fp8)
  return jax.lax.platform_dependent(q_BxKxGxE, layer, start_B, index, cpu=reference, cuda=cuda,
                                    rocm=reference, tpu=reference, default=reference)


def as_stored(x_BxTxKxE, cfg: ModelConfig, storage, dtype) -> jax.Array:
  """Keys or values rounded as the cache stores them and read back (`write` then `read`), in `dtype`."""
  if quantized(cfg):
    return kv_fake_quant(x_BxTxKxE, cfg).astype(dtype)
  return x_BxTxKxE.astype(storage).astype(dtype)


def prefill_attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, start_B, cfg: ModelConfig, storage) -> jax.Array:
  """A prefill from slot 0 (its T tokens are every key there is): the training path's fused attention
  (cuDNN's kernel on a GPU), causal over the new tokens, keys before each row's start masked, keys and
  values rounded as the cache stores them. `[B, T, H, E]`."""
  dt = jnp.dtype(cfg.dtype)
  t = q_BxTxHxE.shape[1]
  slot = jnp.arange(t)
  mask = (slot[None, :] >= start_B[:, None])[:, None, None, :] & (slot[:, None] >= slot[None, :])[None, None]
  k, v = (as_stored(x, cfg, storage, dt) for x in (k_BxTxKxE, v_BxTxKxE))
  impl = training_attention.attention_backend(cfg.attention_impl, dt, cfg.head_dim, training_attention._platform())
  return training_attention.fused_attention(q_BxTxHxE.astype(dt), k, v, mask, False, impl, training=False)


def attention(q_BxTxKxGxE, layer: dict, start_B, index, dtype, cfg: ModelConfig) -> jax.Array:
  """`[B, T, K, G, E]`: a decode step (T = 1) through `decode_attention`, a prefill through the
  reference."""
  if q_BxTxKxGxE.shape[1] == 1:
    return decode_attention(q_BxTxKxGxE[:, 0], layer, start_B, index, dtype, cfg)[:, None]
  return attention_reference(q_BxTxKxGxE, layer, start_B, index, dtype, cfg)
