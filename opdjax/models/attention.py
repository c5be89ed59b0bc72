"""Attention for training and scoring: the `Attention` layer and the implementation it runs (cuDNN's
or XLA's `jax.nn.dot_product_attention`, `attention_backend`: cuDNN's fused kernel on a GPU when it
takes the dtype and head_dim, XLA's elsewhere, `ModelConfig.attention_impl`). An engine's prefill and
decode steps attend over the KV cache in `opdjax.models.kv_cache`. Shapes as in `opdjax.models.decoder`.
"""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp

from opdjax.models.config import ModelConfig
from opdjax.models.layers import RMSNorm, dense, kv_fake_quant, rope

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


def drops_key_mask(cfg: ModelConfig) -> bool:
  """Whether attention without a cache runs on each row's tokens moved to its start, under causality
  alone (`left_aligned`): where cuDNN runs it, a key-padding mask is a `[B, 1, T, T]` bias that every
  layer reads and, in its backward, writes a gradient of. XLA keeps the mask, so the CPU numbers stay
  those of the masked attention."""
  return attention_backend(cfg.attention_impl, jnp.dtype(cfg.dtype), cfg.head_dim, _platform()) == "cudnn"


def left_aligned(mask_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(order, inverse)`, `[B, T]` indices along T: `take_along_axis(x, order)` rotates each row so its
  first real token is at 0, `inverse` rotates back. A row's real tokens are one run (left-padded
  prompt, right-padded completion: `rollout.base.model_inputs`), so afterwards they are `[0, n)`:
  causality alone keeps every real query off the padding (which now follows it), the same keys the
  key mask allowed. Padded positions attend differently; every reduction masks them out."""
  t = mask_BxT.shape[1]
  start = jnp.argmax(mask_BxT.astype(bool), axis=1)[:, None]  # 0 for a row without a real token
  ids = jnp.arange(t)[None, :]
  return (ids + start) % t, (ids - start) % t


def _compile_check(fn, abstract) -> None:
  """Compiles `fn` at these shapes on this GPU, so a cuDNN graph that fails to build (an error XLA
  raises only when it compiles the fused call, long after tracing passed) is a fallback, not a crash
  of the whole program's compile. Off a real GPU (a test standing one in) nothing compiles."""
  if jax.default_backend() == "gpu":
    jax.jit(fn).lower(*abstract).compile()


def _cudnn_rejects(q, k, mask, is_causal, training: bool) -> str | None:
  """Why cuDNN refuses these shapes, or None. Its checks run while tracing, a graph it cannot build
  shows when compiling: both are tried once per distinct call on abstract values. `training`: the
  backward is checked too (it has rules of its own, e.g. even lengths with a bias); a prefill, never
  differentiated, is held only to the forward's."""
  key = (q.shape, k.shape, q.dtype, None if mask is None else mask.shape, is_causal, training)
  if key not in _cudnn_verdicts:
    def fwd(q, k, v, mask):
      return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, implementation="cudnn")
    fn = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if training else fwd
    try:
      # No tracer closed over; a missing mask stays None.
      abstract = [None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, k, mask)]
      jax.eval_shape(fn, *abstract)
      _compile_check(fn, abstract)
      _cudnn_verdicts[key] = None
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
      _cudnn_verdicts[key] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return _cudnn_verdicts[key]


def _even(q, k, v, mask):
  """Odd lengths padded by one key (masked, or after every real query under causality) and one query
  (sliced off the output, so its zero cotangent adds nothing to dK, dV): jax 0.10's cuDNN backward
  takes only even lengths (its check sees a bias even where there is none), and a rollout's
  sequences are `max_len - 1` long."""
  t, s = q.shape[1] % 2, k.shape[1] % 2
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))
  if mask is not None:  # the padded query row repeats the last one's mask (no empty softmax)
    mask = jnp.pad(jnp.pad(mask, [(0, 0), (0, 0), (0, t), (0, 0)], mode="edge"), [(0, 0), (0, 0), (0, 0), (0, s)])
  return pad(q, t), pad(k, s), pad(v, s), mask


def fused_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_Bx1xTxS, is_causal: bool, impl: str,
                    training: bool = True) -> jax.Array:
  """`jax.nn.dot_product_attention` (GQA, boolean mask or None: no padding), through cuDNN when
  `impl` is `cudnn` and it accepts the shapes, else through XLA. `training`: the call may be
  differentiated (no cache), so cuDNN's backward must take it too."""
  if impl == "cudnn":
    q, k, v, mask = q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_Bx1xTxS
    odd = q.shape[1] % 2 or k.shape[1] % 2
    if training and odd and (mask is not None or (is_causal and q.shape[1] == k.shape[1])):
      q, k, v, mask = _even(q, k, v, mask)
    why = _cudnn_rejects(q, k, mask, is_causal, training)
    if why is None:
      out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, implementation="cudnn")
      return out[:, :q_BxTxHxE.shape[1]]
    _notice_once(f"opdjax attention: cuDNN rejected q {q_BxTxHxE.shape} / kv {k_BxSxKxE.shape} {q_BxTxHxE.dtype}"
                 f" ({why}); using the XLA implementation.")
  return jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xTxS, is_causal=is_causal,
                                      implementation="xla")


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, attention_mask):
    """Fused causal attention over the T tokens (`attention_mask` `[B, T]` key padding, or None)."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    b, t, _ = x_BxTxD.shape
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = dense(h * e, cfg.attention_bias, "q_proj", cfg)(x_BxTxD).reshape(b, t, h, e)
    kk = dense(k * e, cfg.attention_bias, "k_proj", cfg)(x_BxTxD).reshape(b, t, k, e)
    v = dense(k * e, cfg.attention_bias, "v_proj", cfg)(x_BxTxD).reshape(b, t, k, e)
    if cfg.qk_norm:
      q = RMSNorm(cfg.rms_norm_eps, name="q_norm")(q)
      kk = RMSNorm(cfg.rms_norm_eps, name="k_norm")(kk)
    q = rope(q, positions_BxT, cfg.rope_theta)
    kk = rope(kk, positions_BxT, cfg.rope_theta)
    if cfg.kv_quant != "none":
      kk, v = kv_fake_quant(kk, cfg), kv_fake_quant(v, cfg)
    q, kk, v = q.astype(dt), kk.astype(dt), v.astype(dt)
    # cuDNN turns a mask into a [B, 1, T, T] bias (and its gradient); is_causal lets it skip the upper
    # triangle. Rows the decoder left-aligned (`drops_key_mask`) or without padding come as None.
    key_mask = None if attention_mask is None else jnp.broadcast_to(
        attention_mask[:, None, None, :].astype(bool), (b, 1, t, t))
    out = fused_attention(q, kk, v, key_mask, True, attention_backend(cfg.attention_impl, dt, e, _platform()))
    return dense(cfg.hidden_size, cfg.o_proj_bias, "o_proj", cfg)(out.reshape(b, t, h * e))
