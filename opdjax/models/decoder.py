"""One Flax (Linen) decoder for the Llama, Qwen2 and Qwen3 families.

Contract (gemma style): `apply(params, tokens, positions, attention_mask, cache)
-> (logits_fp32, cache)`. The KV cache is a plain dict pytree that is passed in
and returned, updated with `dynamic_update_slice`, never mutated.

Shapes: B batch, T new tokens, S cache slots, D model width, H query heads,
K key/value heads, G = H // K query heads per kv head, E head_dim, V vocab.
Without a cache, `attention_mask` is the key-padding mask `[B, T]`; with a cache
it is the mask of valid cache slots `[B, S]` (after writing the new tokens), and
the new tokens are written at slot `cache["index"]`.

The decoder layers are one `nn.scan` over stacked params (`params["layers"][...]` has a leading
`[L]` axis) and a stacked cache (`[L, B, S, K, E]`), so compile time does not grow with depth.

Attention: training, scoring and prefill use `jax.nn.dot_product_attention` (cuDNN's fused kernel
on a GPU when it takes the dtype and head_dim, XLA's elsewhere: `ModelConfig.attention_impl`); a
decode step reads only a window of the cache that holds the tokens so far (`decode_windows`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from opdjax.errors import UserError
from opdjax.models import quant
from opdjax.models.config import ModelConfig
from opdjax.parallel.activations import rows as shard_rows

Params = Any
Cache = dict[str, Any]
_NEG_INF = -1e30


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x):
    w = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # Match HF: normalise in fp32, cast back, then scale by the weight.
    return w.astype(x.dtype) * y.astype(x.dtype)


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


def _dense(features: int, bias: bool, name: str, cfg: ModelConfig, act_quant: bool = True) -> Linear:
  return Linear(features, bias, jnp.dtype(cfg.dtype), cfg.act_quant if act_quant else "none", name=name)


# A decode step attends over the first W cache slots, W the smallest window holding the tokens so
# far: DECODE_WINDOW, doubling up to the cache size (`decode_windows`).
DECODE_WINDOW = 512

log = logging.getLogger(__name__)
_noticed: set[str] = set()
_cudnn_verdicts: dict[tuple, str | None] = {}


def _notice_once(msg: str) -> None:
  if msg not in _noticed:
    _noticed.add(msg)
    log.warning(msg)


def _platform() -> str:
  """The backend the program is being traced for (a function, so tests can stand in a GPU)."""
  return jax.default_backend()


def cudnn_limits(dtype, head_dim: int) -> str | None:
  """Why cuDNN's fused attention cannot take this dtype / head_dim, or None when it can."""
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {dtype.name} (it takes bfloat16 or float16)"
  if head_dim > 256 or head_dim % 8:
    return f"head_dim {head_dim} (it takes a multiple of 8 up to 256)"
  return None


def attention_backend(requested: str, dtype, head_dim: int, platform: str) -> str:
  """`xla` or `cudnn` for `jax.nn.dot_product_attention`. `auto` takes cuDNN on a GPU when it can
  and XLA elsewhere, silently; a GPU whose cuDNN cannot take the dtype or head_dim, or `cudnn`
  asked for off a GPU, falls back to XLA with a one-line notice."""
  if requested == "xla" or (requested == "auto" and platform != "gpu"):
    return "xla"
  why = f"the {platform} backend" if platform != "gpu" else cudnn_limits(dtype, head_dim)
  if why:
    _notice_once(f"opdjax attention: cuDNN cannot take {why}; using the XLA implementation.")
    return "xla"
  return "cudnn"


def _cudnn_rejects(q, k, mask, is_causal) -> str | None:
  """Why cuDNN refuses these shapes (its checks run while tracing), or None. The forward and the
  backward are traced once on abstract values, so a refusal of the backward also shows here."""
  key = (q.shape, k.shape, q.dtype, mask.shape, is_causal)
  if key not in _cudnn_verdicts:
    def loss(q, k, v, mask):
      return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, implementation="cudnn").sum()
    try:
      abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, k, mask)]  # no tracer closed over
      jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), *abstract)
      _cudnn_verdicts[key] = None
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
      _cudnn_verdicts[key] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return _cudnn_verdicts[key]


def fused_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_Bx1xTxS, is_causal: bool, impl: str) -> jax.Array:
  """`jax.nn.dot_product_attention` (GQA, boolean mask), through cuDNN when `impl` is `cudnn` and it
  accepts the shapes, else through XLA."""
  if impl == "cudnn":
    why = _cudnn_rejects(q_BxTxHxE, k_BxSxKxE, mask_Bx1xTxS, is_causal)
    if why is None:
      return jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xTxS, is_causal=is_causal,
                                          implementation="cudnn")
    _notice_once(f"opdjax attention: cuDNN rejected q {q_BxTxHxE.shape} / kv {k_BxSxKxE.shape} {q_BxTxHxE.dtype}"
                 f" ({why}); using the XLA implementation.")
  return jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xTxS, is_causal=is_causal,
                                      implementation="xla")


def decode_attention(q_BxKxGxE, k_new_BxKxE, v_new_BxKxE, kv, layer, kv_mask_BxS, index, window: int, dtype):
  """One new token per row against the cache's first `window` slots, which the step only reads.

  The slots written before this step (`< index`, under the slot mask) and the new token's own key
  and value (written to slot `index` after the layer scan, outside the window switch, so no branch
  updates the cache and XLA never copies it) are two blocks of one softmax, merged by their max.
  Returns `[B, K, G, E]` in `dtype`."""
  scale = q_BxKxGxE.shape[-1] ** -0.5
  keys = kv["k"][layer, :, :window].astype(dtype)
  values = kv["v"][layer, :, :window].astype(dtype)
  old = kv_mask_BxS[:, :window].astype(bool) & (jnp.arange(window) < index)[None, :]
  own = jnp.take(kv_mask_BxS, index, axis=1).astype(bool)  # [B]: the new token's slot is unmasked
  s_old = jnp.einsum("bkge,bske->bkgs", q_BxKxGxE, keys, preferred_element_type=jnp.float32) * scale
  s_old = jnp.where(old[:, None, None, :], s_old, _NEG_INF)
  s_own = jnp.einsum("bkge,bke->bkg", q_BxKxGxE, k_new_BxKxE.astype(dtype), preferred_element_type=jnp.float32)
  s_own = jnp.where(own[:, None, None], s_own * scale, _NEG_INF)
  m = jnp.maximum(jnp.max(s_old, axis=-1), s_own)
  # Masked entries get weight 0 explicitly: a row with nothing unmasked has m = _NEG_INF as well.
  p_old = jnp.where(old[:, None, None, :], jnp.exp(s_old - m[..., None]), 0.0)
  p_own = jnp.where(own[:, None, None], jnp.exp(s_own - m), 0.0)
  norm = jnp.sum(p_old, axis=-1) + p_own
  out = (jnp.einsum("bkgs,bske->bkge", p_old.astype(dtype), values, preferred_element_type=jnp.float32)
         + p_own[..., None] * v_new_BxKxE.astype(jnp.float32)[:, :, None, :])
  return (out / jnp.where(norm > 0, norm, 1.0)[..., None]).astype(dtype)


def decode_windows(slots: int) -> tuple[int, ...]:
  """The cache prefixes a decode step may attend over: DECODE_WINDOW, doubled until the cache size.

  `Model.hidden` picks the smallest that holds the tokens so far (one `lax.switch` per step, outside
  the layer scan; each branch straight-line code over a static prefix that it only reads), so a step
  reads at most twice the filled part of the cache and its cost grows with the tokens so far, not
  with the preallocated size. A dynamic-length loop over blocks would read exactly the filled part,
  but a GPU syncs with the host at every iteration of a loop whose trip count is data."""
  windows = [min(DECODE_WINDOW, slots)]
  while windows[-1] < slots:
    windows.append(min(2 * windows[-1], slots))
  return tuple(windows)


class Attention(nn.Module):
  cfg: ModelConfig
  window: int | None = None  # with a cache: attend over its first `window` slots (None: all)

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, attention_mask, kv, layer, index):
    """`kv`: None, or every layer's cache `{"k", "v": [L, B, S, K, E]}`; this layer's slice is `layer`.
    Returns `(out, kv, new)`.

    Without a cache (training, scoring): fused causal attention over the T tokens. With a cache and
    several new tokens (a prefill): they are written into the cache and attend over all of it under
    the slot mask. One new token (a decode step): it attends over the cache's first `window` slots
    and itself, leaving the cache as it is; `new` is its `(key, value)` for the caller to write."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    b, t, _ = x_BxTxD.shape
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = _dense(h * e, cfg.attention_bias, "q_proj", cfg)(x_BxTxD).reshape(b, t, h, e)
    kk = _dense(k * e, cfg.attention_bias, "k_proj", cfg)(x_BxTxD).reshape(b, t, k, e)
    v = _dense(k * e, cfg.attention_bias, "v_proj", cfg)(x_BxTxD).reshape(b, t, k, e)
    if cfg.qk_norm:
      q = RMSNorm(cfg.rms_norm_eps, name="q_norm")(q)
      kk = RMSNorm(cfg.rms_norm_eps, name="k_norm")(kk)
    q = rope(q, positions_BxT, cfg.rope_theta)
    kk = rope(kk, positions_BxT, cfg.rope_theta)
    if cfg.kv_quant != "none":
      kk, v = kv_fake_quant(kk, cfg), kv_fake_quant(v, cfg)
    q, kk, v = q.astype(dt), kk.astype(dt), v.astype(dt)
    new = None

    if kv is None:
      # cuDNN wants the mask as a [B, 1, T, S] bias; is_causal lets it skip the upper triangle.
      key_mask = jnp.broadcast_to(attention_mask[:, None, None, :].astype(bool), (b, 1, t, t))
      out = fused_attention(q, kk, v, key_mask, True, attention_backend(cfg.attention_impl, dt, e, _platform()))
    elif t == 1:
      # Rounded as the cache stores them, so the step sees what later steps will read back.
      new = (kk[:, 0].astype(kv["k"].dtype), v[:, 0].astype(kv["v"].dtype))
      out = decode_attention(q.reshape(b, k, h // k, e), *new, kv, layer, attention_mask, index,
                             self.window or kv["k"].shape[2], dt)
    else:
      # Only the new tokens are written, into the stacked cache the scan carries, so a prefill
      # updates the cache in place instead of copying a layer's slice out and back.
      at = (layer, 0, index, 0, 0)
      kv = {"k": jax.lax.dynamic_update_slice(kv["k"], kk[None].astype(kv["k"].dtype), at),
            "v": jax.lax.dynamic_update_slice(kv["v"], v[None].astype(kv["v"].dtype), at)}
      causal_TxS = (index + jnp.arange(t))[:, None] >= jnp.arange(kv["k"].shape[2])[None, :]
      mask = causal_TxS[None, None] & attention_mask[:, None, None, :].astype(bool)
      out = fused_attention(q, kv["k"][layer].astype(dt), kv["v"][layer].astype(dt), mask, False,
                            attention_backend(cfg.attention_impl, dt, e, _platform()))
    out = out.reshape(b, t, h * e)
    return _dense(cfg.hidden_size, cfg.o_proj_bias, "o_proj", cfg)(out), kv, new


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    gate = _dense(cfg.intermediate_size, cfg.mlp_bias, "gate_proj", cfg)(x)
    up = _dense(cfg.intermediate_size, cfg.mlp_bias, "up_proj", cfg)(x)
    return _dense(cfg.hidden_size, cfg.mlp_bias, "down_proj", cfg)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  """One layer as a scan body: carry `(x, kv)`, scanned over the layer index; outputs a decode step's
  new `(key, value)` (stacked by the scan: `[L, B, K, E]`), else None."""

  cfg: ModelConfig
  window: int | None = None

  @nn.compact
  def __call__(self, carry, layer, positions, attention_mask, index):
    x, kv = carry
    x = shard_rows(x)  # on a mesh: the batch's rows stay split (opdjax.parallel.activations)
    cfg = self.cfg
    h = RMSNorm(cfg.rms_norm_eps, name="input_layernorm")(x)
    a, kv, new = Attention(cfg, self.window, name="self_attn")(h, positions, attention_mask, kv, layer, index)
    x = x + a
    h = RMSNorm(cfg.rms_norm_eps, name="post_attention_layernorm")(x)
    return (x + MLP(cfg, name="mlp")(h), kv), new


# What the backward pass keeps of each layer's forward: everything, the matmul outputs (the
# attention einsums, which have batch dims, are recomputed), or only the layer's input.
REMAT_POLICIES = {
    "nothing": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def check_remat_policy(name: str) -> str:
  if name not in REMAT_POLICIES:
    raise UserError(f"remat_policy={name!r}: choose one of {', '.join(REMAT_POLICIES)}"
                    " (nothing: keep all activations; dots: keep matmul outputs; full: recompute each layer).")
  return name


def scanned_layers(cfg: ModelConfig, remat_policy: str, name: str = "layers", unroll: bool = False,
                   window: int | None = None) -> nn.Module:
  """Every decoder layer as one `nn.scan`: params stacked on a leading `[L]` axis, one compiled body
  (`unroll`: the same scan as straight-line code, for cost analyses that count a loop body once;
  `window`: a decode step's cache window)."""
  layer = DecoderLayer
  if REMAT_POLICIES[check_remat_policy(remat_policy)] is not None:
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging the recomputation back.
    layer = nn.remat(DecoderLayer, policy=REMAT_POLICIES[remat_policy], prevent_cse=False)
  scan = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                 in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.num_layers,
                 unroll=cfg.num_layers if unroll else 1)
  return scan(cfg, window, name=name)


class Decoder(nn.Module):
  """Returns the final hidden states `[B, T, D]`; `logits` projects them."""

  cfg: ModelConfig
  remat_policy: str = "nothing"
  unroll_layers: bool = False
  window: int | None = None

  def setup(self):
    cfg = self.cfg
    self.embed_tokens = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, param_dtype=jnp.float32,
        embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
    self.layers = scanned_layers(cfg, self.remat_policy, unroll=self.unroll_layers, window=self.window)
    self.norm = RMSNorm(cfg.rms_norm_eps, name="norm")
    if not cfg.tie_word_embeddings:
      self.lm_head = _dense(cfg.vocab_size, False, "lm_head", cfg, act_quant=False)

  def __call__(self, tokens_BxT, positions_BxT, attention_mask, cache: Cache | None = None):
    if cache is not None and tokens_BxT.shape[1] == 1:
      x, new = self.decode_step(tokens_BxT, positions_BxT, attention_mask, cache)
      return x, write_step(cache, new)
    x = self.embed_tokens(tokens_BxT).astype(jnp.dtype(self.cfg.dtype))
    kv = None if cache is None else {"k": cache["k"], "v": cache["v"]}
    index = None if cache is None else cache["index"]
    layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
    (x, kv), _ = self.layers((x, kv), layer_ids, positions_BxT, attention_mask, index)
    x = self.norm(x)
    if cache is not None:
      cache = {"index": index + tokens_BxT.shape[1], **kv}
    return x, cache

  def decode_step(self, tokens_Bx1, positions_Bx1, attention_mask, cache: Cache):
    """`(hidden [B, 1, D], (keys, values) [L, B, K, E])` of one new token per row; reads the cache only."""
    x = self.embed_tokens(tokens_Bx1).astype(jnp.dtype(self.cfg.dtype))
    kv = {"k": cache["k"], "v": cache["v"]}
    layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
    (x, _), new = self.layers((x, kv), layer_ids, positions_Bx1, attention_mask, cache["index"])
    return self.norm(x), new

  def logits(self, hidden_BxTxD):
    """fp32 logits from hidden states (also usable on a chunk of positions)."""
    if self.cfg.tie_word_embeddings:
      w_DxV = self.embed_tokens.embedding.T
    else:
      w_DxV = self.lm_head.variables["params"]["kernel"]
    dt = jnp.dtype(self.cfg.dtype)
    return jnp.einsum("...d,dv->...v", hidden_BxTxD.astype(dt), w_DxV.astype(dt),
                      preferred_element_type=jnp.float32)

  def init_all(self, tokens_BxT):
    """Touches every parameter (used by `init`)."""
    pos = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    h, _ = self(tokens_BxT, pos, jnp.ones_like(tokens_BxT))
    if not self.cfg.tie_word_embeddings:
      return self.lm_head(h)
    return h


class Model:
  """Pure-functional handle on the decoder: params are a plain pytree, the decoder layers' stacked
  under `params["layers"]` (leading axis: the layer)."""

  def __init__(self, cfg: ModelConfig, remat_policy: str = "nothing", unroll_layers: bool = False):
    """`unroll_layers`: lower the layer scan as straight-line code (same numbers, slower compiles),
    so that XLA's cost analysis, which counts a loop body once, counts every layer."""
    self.cfg = cfg
    self.remat_policy = check_remat_policy(remat_policy)
    self.unroll_layers = unroll_layers
    self.module = Decoder(cfg, remat_policy=remat_policy, unroll_layers=unroll_layers)

  def init(self, rng: jax.Array) -> Params:
    tokens = jnp.zeros((1, 2), jnp.int32)
    return self.module.init(rng, tokens, method=Decoder.init_all)["params"]

  def hidden(self, params, tokens, positions, attention_mask, cache=None):
    """`(hidden [B, T, D], cache)`. A decode step (one new token per row) attends over the smallest
    of the cache's `decode_windows` that holds the tokens so far; the branches only read the cache
    and the new keys and values are written after the switch."""
    if cache is None or tokens.shape[1] != 1:
      return self.module.apply({"params": params}, tokens, positions, attention_mask, cache)
    windows = decode_windows(cache["k"].shape[2])
    branches = [functools.partial(self._decode_step, w) for w in windows]
    pick = jnp.minimum(jnp.searchsorted(jnp.asarray(windows), cache["index"] + 1), len(windows) - 1)
    args = (params, tokens, positions, attention_mask, cache)
    h, new = jax.lax.switch(pick, branches, *args) if len(windows) > 1 else branches[0](*args)
    return h, write_step(cache, new)

  def _decode_step(self, window, params, tokens, positions, attention_mask, cache):
    decoder = Decoder(self.cfg, remat_policy=self.remat_policy, unroll_layers=self.unroll_layers, window=window)
    return decoder.apply({"params": params}, tokens, positions, attention_mask, cache, method=Decoder.decode_step)

  def logits(self, params, hidden):
    return self.module.apply({"params": params}, hidden, method=Decoder.logits)

  def output_matrix(self, params) -> jax.Array:
    """The `[D, V]` matrix `logits` multiplies by (the embedding's transpose when tied)."""
    if self.cfg.tie_word_embeddings:
      return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]

  def apply(self, params, tokens, positions, attention_mask, cache=None):
    """`(logits_fp32 [B, T, V], cache)`."""
    h, cache = self.hidden(params, tokens, positions, attention_mask, cache)
    return self.logits(params, h), cache

  def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
    """`{"index": i32, "k", "v": [L, B, S, K, E]}`: every layer's keys and values, stacked."""
    cfg = self.cfg
    dt = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return {"index": jnp.zeros((), jnp.int32), "k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


def write_step(cache: Cache, new) -> Cache:
  """The cache with a decode step's `(keys, values) [L, B, K, E]` written at slot `index`, in place."""
  at = (0, 0, cache["index"], 0, 0)
  return {"index": cache["index"] + 1, "k": jax.lax.dynamic_update_slice(cache["k"], new[0][:, :, None], at),
          "v": jax.lax.dynamic_update_slice(cache["v"], new[1][:, :, None], at)}


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """RoPE positions for left- or right-padded rows: 0 at each row's first real token."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)
