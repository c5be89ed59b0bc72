"""One Flax (Linen) decoder for the Llama, Qwen2 and Qwen3 families.

Contract (gemma style): `apply(params, tokens, positions, attention_mask, cache)
-> (logits_fp32, cache)`. The KV cache is a plain dict pytree that is passed in
and returned, updated with `dynamic_update_slice`, never mutated.

Shapes: B batch, T new tokens, S cache slots, D model width, H query heads,
K key/value heads, G = H // K query heads per kv head, E head_dim, V vocab.
Without a cache, `attention_mask` is the key-padding mask `[B, T]`, each row's real tokens one run
(padding before and after it; None: no padding); with a cache it is the mask of valid cache slots
`[B, S]` (after writing the new tokens; a row's valid slots are one run), and the new tokens are
written at slot `cache["index"]`.

Without a cache (training, scoring) the decoder layers are one `nn.scan` over stacked params
(`params["layers"][...]` has a leading `[L]` axis), so compile time does not grow with depth. With a
cache the layers run as an engine runs them (`opdjax.models.inference`: per-layer weights, one KV buffer
per layer, `opdjax.models.kv_cache`); `Model.apply` prepares those weights from `params` on every call,
an engine once per weight version.

Attention lives in `opdjax.models.attention`, the building blocks (RMSNorm, RoPE, the projection) in
`opdjax.models.layers`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from opdjax.errors import UserError
from opdjax.models import inference, kv_cache
from opdjax.models.attention import (  # noqa: F401  (re-exported: callers import these from here)
  Attention,
  attention_backend,
  cudnn_limits,
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
  """One layer as a scan body: carry `x`, the same positions and mask for every layer."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, _, positions, attention_mask):
    x = shard_rows(x)  # on a mesh: the batch's rows stay split (opdjax.parallel.activations)
    cfg = self.cfg
    h = RMSNorm(cfg.rms_norm_eps, name="input_layernorm")(x)
    x = x + Attention(cfg, name="self_attn")(h, positions, attention_mask)
    h = RMSNorm(cfg.rms_norm_eps, name="post_attention_layernorm")(x)
    return x + MLP(cfg, name="mlp")(h), None


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


def scanned_layers(cfg: ModelConfig, remat_policy: str, name: str = "layers", unroll: bool = False) -> nn.Module:
  """Every decoder layer as one `nn.scan`: params stacked on a leading `[L]` axis, one compiled body
  (`unroll`: the same scan as straight-line code, for cost analyses that count a loop body once)."""
  layer = DecoderLayer
  if REMAT_POLICIES[check_remat_policy(remat_policy)] is not None:
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging the recomputation back.
    layer = nn.remat(DecoderLayer, policy=REMAT_POLICIES[remat_policy], prevent_cse=False)
  scan = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                 in_axes=(0, nn.broadcast, nn.broadcast), length=cfg.num_layers,
                 unroll=cfg.num_layers if unroll else 1)
  return scan(cfg, name=name)


class Decoder(nn.Module):
  """Returns the final hidden states `[B, T, D]`; `logits` projects them."""

  cfg: ModelConfig
  remat_policy: str = "nothing"
  unroll_layers: bool = False

  def setup(self):
    cfg = self.cfg
    self.embed_tokens = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, param_dtype=jnp.float32,
        embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
    self.layers = scanned_layers(cfg, self.remat_policy, unroll=self.unroll_layers)
    self.norm = RMSNorm(cfg.rms_norm_eps, name="norm")
    if not cfg.tie_word_embeddings:
      self.lm_head = dense(cfg.vocab_size, False, "lm_head", cfg, act_quant=False)

  def __call__(self, tokens_BxT, positions_BxT, attention_mask):
    inverse = None
    if attention_mask is not None and drops_key_mask(self.cfg):
      order, inverse = left_aligned(attention_mask)
      tokens_BxT, positions_BxT = (jnp.take_along_axis(a, order, axis=1) for a in (tokens_BxT, positions_BxT))
      attention_mask = None
    x = self.embed_tokens(tokens_BxT).astype(jnp.dtype(self.cfg.dtype))
    layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
    x, _ = self.layers(x, layer_ids, positions_BxT, attention_mask)
    if inverse is not None:  # back to the caller's layout
      x = jnp.take_along_axis(x, inverse[..., None], axis=1)
    return self.norm(x)

  def logits(self, hidden_BxTxD):
    """fp32 logits from hidden states (also usable on a chunk of positions)."""
    if self.cfg.tie_word_embeddings:
      w_DxV = self.embed_tokens.embedding.T
    else:
      w_DxV = self.lm_head.variables["params"]["kernel"]
    w_DxV = w_DxV[:, :self.cfg.logit_size]  # padded rows beyond the shared tokenizer get no logit
    dt = jnp.dtype(self.cfg.dtype)
    return jnp.einsum("...d,dv->...v", hidden_BxTxD.astype(dt), w_DxV.astype(dt),
                      preferred_element_type=jnp.float32)

  def init_all(self, tokens_BxT):
    """Touches every parameter (used by `init`)."""
    pos = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    h = self(tokens_BxT, pos, jnp.ones_like(tokens_BxT))
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
    """`(hidden [B, T, D], cache)`; with a cache, through `opdjax.models.inference` (weights prepared here)."""
    if cache is not None:
      return inference.forward(inference.prepare(params, self.cfg), cache, tokens, positions,
                               inference.slot_starts(attention_mask), self.cfg)
    with matmul_precision(self.cfg.dtype):
      return self.module.apply({"params": params}, tokens, positions, attention_mask), None

  def logits(self, params, hidden):
    with matmul_precision(self.cfg.dtype):
      return self.module.apply({"params": params}, hidden, method=Decoder.logits)

  def output_matrix(self, params) -> jax.Array:
    """The `[D, V]` matrix `logits` multiplies by (the embedding's transpose when tied), V = `cfg.logit_size`:
    the rows beyond the shared tokenizer are padding and get no logit (their gradient is zero)."""
    if self.cfg.tie_word_embeddings:
      return params["embed_tokens"]["embedding"][:self.cfg.logit_size].T
    return params["lm_head"]["kernel"][:, :self.cfg.logit_size]

  def apply(self, params, tokens, positions, attention_mask, cache=None):
    """`(logits_fp32 [B, T, V], cache)`."""
    h, cache = self.hidden(params, tokens, positions, attention_mask, cache)
    return self.logits(params, h), cache

  def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
    """An empty KV cache (`opdjax.models.kv_cache`: `{"index", "layers": per layer {"k", "v": [B, K, S, E]}}`)."""
    return kv_cache.init_cache(self.cfg, batch, max_len, dtype)


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """RoPE positions for left- or right-padded rows: 0 at each row's first real token."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)
