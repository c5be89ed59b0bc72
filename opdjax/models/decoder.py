"""One Flax (Linen) decoder for the Llama, Qwen2 and Qwen3 families.

Contract (gemma style): `apply(params, tokens, positions, attention_mask, cache)
-> (logits_fp32, cache)`. The KV cache is a plain dict pytree that is passed in
and returned, updated with `dynamic_update_slice`, never mutated.

Shapes: B batch, T new tokens, S cache slots, D model width, H query heads,
K key/value heads, G = H // K query heads per kv head, E head_dim, V vocab.
Without a cache, `attention_mask` is the key-padding mask `[B, T]`, each row's real tokens one run
(padding before and after it; None: no padding); with a cache it is the mask of valid cache slots
`[B, S]` (after writing the new tokens), and the new tokens are written at slot `cache["index"]`.

The decoder layers are one `nn.scan` over stacked params (`params["layers"][...]` has a leading
`[L]` axis) and a stacked cache (`[L, B, S, K, E]`), so compile time does not grow with depth.

Attention and the decode windows live in `opdjax.models.attention`, the building blocks (RMSNorm,
RoPE, the projection) in `opdjax.models.layers`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from opdjax.errors import UserError
from opdjax.models.attention import (  # noqa: F401  (re-exported: callers import these from here)
  DECODE_WINDOW,
  Attention,
  attention_backend,
  cudnn_limits,
  decode_attention,
  decode_windows,
  drops_key_mask,
  fused_attention,
  left_aligned,
)
from opdjax.models.config import ModelConfig
from opdjax.models.layers import Linear, RMSNorm, dense, kv_fake_quant, matmul_precision, rope  # noqa: F401
from opdjax.parallel.activations import rows as shard_rows

Params = Any
Cache = dict[str, Any]


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    gate = dense(cfg.intermediate_size, cfg.mlp_bias, "gate_proj", cfg)(x)
    up = dense(cfg.intermediate_size, cfg.mlp_bias, "up_proj", cfg)(x)
    return dense(cfg.hidden_size, cfg.mlp_bias, "down_proj", cfg)(nn.silu(gate) * up)


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
      self.lm_head = dense(cfg.vocab_size, False, "lm_head", cfg, act_quant=False)

  def __call__(self, tokens_BxT, positions_BxT, attention_mask, cache: Cache | None = None):
    if cache is not None and tokens_BxT.shape[1] == 1:
      x, new = self.decode_step(tokens_BxT, positions_BxT, attention_mask, cache)
      return x, write_step(cache, new)
    inverse = None
    if cache is None and attention_mask is not None and drops_key_mask(self.cfg):
      order, inverse = left_aligned(attention_mask)
      tokens_BxT, positions_BxT = (jnp.take_along_axis(a, order, axis=1) for a in (tokens_BxT, positions_BxT))
      attention_mask = None
    x = self.embed_tokens(tokens_BxT).astype(jnp.dtype(self.cfg.dtype))
    kv = None if cache is None else {"k": cache["k"], "v": cache["v"]}
    index = None if cache is None else cache["index"]
    layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
    (x, kv), _ = self.layers((x, kv), layer_ids, positions_BxT, attention_mask, index)
    if inverse is not None:  # back to the caller's layout
      x = jnp.take_along_axis(x, inverse[..., None], axis=1)
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
    with matmul_precision(self.cfg.dtype):
      return self._hidden(params, tokens, positions, attention_mask, cache)

  def _hidden(self, params, tokens, positions, attention_mask, cache):
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
    with matmul_precision(self.cfg.dtype):
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
