"""The decoder as an engine runs it: over per-layer, fused weights prepared once per weight version,
and a per-layer KV cache (opdjax.models.kv_cache).

Training and scoring run the Flax decoder (`opdjax.models.decoder`), whose layers are one scan over
stacked params: there a stacked array sliced per layer is the point (one compiled body, gradients
stacked alike). A decode step is the opposite case: it moves every weight once per token, and a
stacked weight sliced in the loop is a copy per layer per step. So `prepare` (jit-able, pure) turns
the stacked params into one tuple entry per layer, with q|k|v and gate|up fused into one matrix each
and every leaf in the compute dtype, once, where an engine installs its weights; `forward` runs the
layers as straight-line code over those entries, RoPE tables computed once per step. Numerics are the
Flax decoder's (the same RMSNorm, RoPE and KV rounding functions; tested against it).

Matrices: a plain array `[in, out]` in the compute dtype; `W8A16` (an fp8 e4m3 matrix with per-tensor or
per-channel scales, from a `weights` view's packed `QArray`s) multiplied as fp8 upcast inside the dot,
the scale applied to the product; a transposed e4m3 `QArray` for `fp8_matmul` models (W8A8 on FP8
tensor cores, `quant.fp8_dot`). Other packed formats (int8, block scales, e5m2) are dequantized here,
once, not per step.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from opdjax.models import kv_cache, quant
from opdjax.models.config import ModelConfig
from opdjax.models.layers import apply_rope, matmul_precision, quantize_activations, rms_norm, rope_tables
from opdjax.models.quant import QArray
from opdjax.parallel.activations import rows as shard_rows


@flax.struct.dataclass
class W8A16:
  """An `[in, out]` e4m3 matrix and its per-output-channel scales `[1, out]` fp32."""

  q: jax.Array
  scale: jax.Array


def _layer_slice(leaf, i: int, cfg: ModelConfig):
  """Layer i's matrix of a stacked leaf, as the engine multiplies it."""
  dt = jnp.dtype(cfg.dtype)
  if quant.fp8_matmul_ready(leaf):
    q = jnp.swapaxes(leaf.q[i], -1, -2) if leaf.transposed else leaf.q[i]  # [in, out]
    scale = jnp.broadcast_to(leaf.scale[i], (1, q.shape[-1])).astype(jnp.float32)
    if cfg.fp8_matmul:
      return QArray(jnp.swapaxes(q, 0, 1), scale, tuple(q.shape), transposed=True)
    return W8A16(q, scale)
  if isinstance(leaf, QArray):
    leaf = leaf.dequantize()
  return leaf[i].astype(dt)


def _fuse(parts, dt):
  """Matrices sharing an input, concatenated along their outputs (one dot instead of several); a
  group whose members are held in different forms is multiplied in the compute dtype `dt`."""
  kinds = {type(p) for p in parts}
  if kinds == {W8A16}:
    return W8A16(jnp.concatenate([p.q for p in parts], -1), jnp.concatenate([p.scale for p in parts], -1))
  if kinds == {QArray}:
    q = jnp.concatenate([p.q for p in parts], 0)
    return QArray(q, jnp.concatenate([p.scale for p in parts], -1), (q.shape[1], q.shape[0]), transposed=True)
  dense = {W8A16: lambda w: w.q.astype(jnp.float32) * w.scale, QArray: QArray.dequantize}
  return jnp.concatenate([dense.get(type(p), lambda w: w)(p).astype(dt) for p in parts], -1)


def prepare(params, cfg: ModelConfig) -> dict:
  """The engine's weights: `{"embed" [V, D], "norm", ("lm_head" [D, V]), "layers": (per layer
  {"input_norm", "qkv", ("qkv_bias"), ("q_norm", "k_norm"), "o", ("o_bias"), "post_norm", "gate_up",
  ("gate_up_bias"), "down", ("down_bias")})}`, floating leaves in the compute dtype. Pure; run it
  under jit once per weight version (`jax.eval_shape` gives an engine's abstract weights)."""
  dt = jnp.dtype(cfg.dtype)
  unpacked = lambda x: (x.dequantize() if isinstance(x, QArray) else x).astype(dt)
  stack = params["layers"]
  attn, mlp = stack["self_attn"], stack["mlp"]
  layers = []
  for i in range(cfg.num_layers):
    at = lambda leaf, i=i: _layer_slice(leaf, i, cfg)
    w = {"input_norm": unpacked(stack["input_layernorm"]["weight"][i]),
         "post_norm": unpacked(stack["post_attention_layernorm"]["weight"][i]),
         "qkv": _fuse([at(attn[n]["kernel"]) for n in ("q_proj", "k_proj", "v_proj")], dt),
         "o": at(attn["o_proj"]["kernel"]),
         "gate_up": _fuse([at(mlp[n]["kernel"]) for n in ("gate_proj", "up_proj")], dt),
         "down": at(mlp["down_proj"]["kernel"])}
    if cfg.attention_bias:
      w["qkv_bias"] = jnp.concatenate([unpacked(attn[n]["bias"][i]) for n in ("q_proj", "k_proj", "v_proj")])
    if cfg.o_proj_bias:
      w["o_bias"] = unpacked(attn["o_proj"]["bias"][i])
    if cfg.qk_norm:
      w["q_norm"], w["k_norm"] = (unpacked(attn[n]["weight"][i]) for n in ("q_norm", "k_norm"))
    if cfg.mlp_bias:
      w["gate_up_bias"] = jnp.concatenate([unpacked(mlp[n]["bias"][i]) for n in ("gate_proj", "up_proj")])
      w["down_bias"] = unpacked(mlp["down_proj"]["bias"][i])
    layers.append(w)
  # Rows beyond the shared tokenizer (`cfg.logit_size`) are padding: no prompt or sample holds their ids, and
  # cut here, once per weight version, they get no logit and so no probability in any sample.
  v = cfg.logit_size
  out = {"embed": unpacked(params["embed_tokens"]["embedding"])[:v], "norm": unpacked(params["norm"]["weight"]),
         "layers": tuple(layers)}  # dequantized before the cut: a packed fp8 table (QArray) is not sliceable
  if not cfg.tie_word_embeddings:
    out["lm_head"] = unpacked(params["lm_head"]["kernel"])[:, :v]
  return out


def project(x, w, bias, cfg: ModelConfig):
  """`x @ w (+ bias)` in the compute dtype; activations rounded per token first for W8A8 numerics."""
  dt = jnp.dtype(cfg.dtype)
  contract = (((x.ndim - 1,), (0,)), ((), ()))
  if isinstance(w, QArray):
    y = quant.fp8_dot(x, w).astype(dt)  # rounds x itself
  else:
    x = quantize_activations(x, cfg.act_quant).astype(dt)
    if isinstance(w, W8A16):  # the fp8 matrix upcast inside the dot, its scale on the fp32 product
      y = (jax.lax.dot_general(x, w.q.astype(dt), contract, preferred_element_type=jnp.float32) * w.scale).astype(dt)
    else:
      y = jax.lax.dot_general(x, w.astype(dt), contract)
  return y if bias is None else y + bias.astype(dt)


def _layer(w, layer, x_BxTxD, rope_cs, index, start_B, cfg: ModelConfig, clear_tail: bool):
  dt = jnp.dtype(cfg.dtype)
  b, t, _ = x_BxTxD.shape
  h, k, e, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  x = shard_rows(x_BxTxD)
  qkv = project(rms_norm(x, w["input_norm"], cfg.rms_norm_eps), w["qkv"], w.get("qkv_bias"), cfg)
  q = qkv[..., :h * e].reshape(b, t, h, e)
  keys = qkv[..., h * e:(h + k) * e].reshape(b, t, k, e)
  values = qkv[..., (h + k) * e:].reshape(b, t, k, e)
  if cfg.qk_norm:
    q, keys = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(keys, w["k_norm"], cfg.rms_norm_eps)
  q, keys = apply_rope(q, *rope_cs), apply_rope(keys, *rope_cs)
  layer = kv_cache.write(layer, keys, values, index, cfg, clear_tail)
  if clear_tail:  # a prefill from slot 0: the new tokens are every key there is
    out = kv_cache.prefill_attention(q, keys, values, start_B, cfg, layer["k"].dtype)
  else:
    out = kv_cache.attention(q.astype(dt).reshape(b, t, k, h // k, e), layer, start_B, index, dt, cfg)
  x = x + project(out.reshape(b, t, h * e), w["o"], w.get("o_bias"), cfg)
  gu = project(rms_norm(x, w["post_norm"], cfg.rms_norm_eps), w["gate_up"], w.get("gate_up_bias"), cfg)
  x = x + project(nn.silu(gu[..., :f]) * gu[..., f:], w["down"], w.get("down_bias"), cfg)
  return x, layer


def forward(prepared, cache, tokens_BxT, positions_BxT, start_B, cfg: ModelConfig, clear_tail: bool = False):
  """`(hidden [B, T, D] after the final norm, cache)`: T new tokens per row written at slots
  `[index, index + T)`, each attending over its row's slots from `start_B` on (opdjax.models.kv_cache).
  `clear_tail`: a prefill at slot 0 also zeroes the slots after it (`kv_cache.write`)."""
  with matmul_precision(cfg.dtype):
    x = jnp.take(prepared["embed"], tokens_BxT, axis=0).astype(jnp.dtype(cfg.dtype))
    rope_cs = rope_tables(positions_BxT, cfg.head_dim, cfg.rope_theta)
    index, layers = cache["index"], []
    for w, layer in zip(prepared["layers"], cache["layers"], strict=True):
      x, layer = _layer(w, layer, x, rope_cs, index, start_B, cfg, clear_tail)
      layers.append(layer)
    x = rms_norm(x, prepared["norm"], cfg.rms_norm_eps)
  return x, {"index": index + tokens_BxT.shape[1], "layers": tuple(layers)}


def logits(prepared, hidden, cfg: ModelConfig):
  """fp32 logits `[..., V]` (the tied embedding contracted over its width, never transposed)."""
  dt = jnp.dtype(cfg.dtype)
  h = hidden.astype(dt)
  with matmul_precision(cfg.dtype):
    if "lm_head" in prepared:
      return jnp.einsum("...d,dv->...v", h, prepared["lm_head"], preferred_element_type=jnp.float32)
    return jnp.einsum("...d,vd->...v", h, prepared["embed"], preferred_element_type=jnp.float32)


def slot_starts(mask_BxS) -> jax.Array:
  """Each row's first filled slot (`[B]`; 0 for a row with none yet): a row's filled slots are one run."""
  return jnp.argmax(mask_BxS.astype(bool), axis=1).astype(jnp.int32)

