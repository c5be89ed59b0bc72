"""The decode step's attention as one Pallas kernel for CUDA (Triton lowering): what
`kv_cache.decode_attention` dispatches to on a GPU, tested against the XLA reference in Pallas's
interpret mode on CPU.

One program per (row, kv head) walks that head's `[S, E]` slots in blocks of `block` from the block
holding the row's first filled slot to the one holding `index`: only the filled slots are read (the XLA
reference reads the whole buffer under a mask). Scores, an online softmax and P·V stay in registers, in
fp32. An fp8 cache is read as its stored bits and converted on load; its per-token scales multiply the
scores (k_scale) and the probabilities (v_scale), so the cache values are exactly those the `kv` view
rounds to, as in the reference. The last block is clamped to end at slot S (slots a previous block
already covered are masked), so the buffer needs no rounding up to the block; a cache shorter than 16
slots, or a head_dim Triton's dot cannot take, stays on the reference (`fits`).

The G query heads sharing a kv head are padded to 16 rows (Triton's smallest dot), which costs nothing
that moves through memory: q is a few KiB a step, the cache gigabytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK = 64  # slots a loop iteration reads: [64, 128] bf16 keys and values are 32 KiB, one stage
MIN_ROWS = 16  # Triton's dot takes no operand dimension below 16
_NEG_INF = -1e30


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def block_for(slots: int) -> int:
  """The slots a loop iteration reads: BLOCK, or the largest power of two a shorter cache holds."""
  return min(BLOCK, 1 << (slots.bit_length() - 1))


def fits(slots: int, head_dim: int) -> bool:
  """Whether the kernel takes this cache: a head_dim Triton's dot and block loads take, 16 slots or more."""
  return _pow2(head_dim) and head_dim >= MIN_ROWS and block_for(slots) >= MIN_ROWS


def _kernel(start_ref, index_ref, q_ref, k_ref, v_ref, *rest, block: int, slots: int, fp8, dtype):
  scale_refs, o_ref = rest[:-1], rest[-1]
  start, index = start_ref[pl.program_id(0)], index_ref[0]
  q = q_ref[...]  # [G16, E] in the compute dtype
  e = q.shape[-1]
  f32 = jnp.dtype(dtype) == jnp.float32
  lo = (start // block) * block
  count = (index + block - lo) // block  # blocks up to the one holding `index`

  def load(ref, s0):
    x = ref[pl.ds(s0, block), :]
    if fp8 is not None:  # the stored bits, a plain convert: the scales go on scores and probabilities
      x = jax.lax.bitcast_convert_type(x, fp8)
    return x.astype(dtype)

  def body(i, carry):
    m, denom, acc = carry
    nominal = lo + i * block
    s0 = jnp.minimum(nominal, slots - block)
    slot = s0 + jnp.arange(block)
    valid = ((slot >= nominal) & (slot >= start) & (slot <= index))[None, :]
    s = plgpu.dot(q, load(k_ref, s0), trans_b=True, allow_tf32=not f32) * (e ** -0.5)
    if scale_refs:
      s = s * scale_refs[0][pl.ds(s0, block)][None, :]
    s = jnp.where(valid, s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    denom = denom * alpha + jnp.sum(p, axis=1)
    if scale_refs:
      p = p * scale_refs[1][pl.ds(s0, block)][None, :]
    pv = plgpu.dot(p.astype(dtype), load(v_ref, s0), allow_tf32=not f32)
    return m_new, denom, acc * alpha[:, None] + pv

  rows = q.shape[0]
  init = (jnp.full((rows,), _NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, e), jnp.float32))
  _, denom, acc = jax.lax.fori_loop(0, count, body, init)
  o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


def decode_attention(q_BxKxGxE, layer: dict, start_B, index, dtype, fp8=None, interpret: bool = False) -> jax.Array:
  """`[B, K, G, E]` in `dtype`: each row's query against its filled slots `[start_b, index]` of `layer`
  (`{"k", "v": [B, K, S, E]}` in `dtype`, or fp8 bits as uint8 with `fp8` their format and, when the cache
  keeps them, `{"k_scale", "v_scale": [B, K, S]}`). `interpret`: Pallas's interpreter (any backend)."""
  b, k, g, e = q_BxKxGxE.shape
  slots = layer["k"].shape[2]
  rows = max(MIN_ROWS, 1 << (g - 1).bit_length())
  q = jnp.pad(q_BxKxGxE.astype(dtype), [(0, 0), (0, 0), (0, rows - g), (0, 0)])
  scales = [layer[n] for n in ("k_scale", "v_scale") if n in layer]
  head = lambda *blk: pl.BlockSpec(blk, lambda i, j: (i, j) + (0,) * (len(blk) - 2))
  whole = lambda n: pl.BlockSpec((n,), lambda i, j: (0,))
  out = pl.pallas_call(
      functools.partial(_kernel, block=block_for(slots), slots=slots, fp8=fp8, dtype=jnp.dtype(dtype)),
      grid=(b, k),
      in_specs=[whole(b), whole(1), head(None, None, rows, e), head(None, None, slots, e),
                head(None, None, slots, e)] + [head(None, None, slots)] * len(scales),
      out_specs=head(None, None, rows, e),
      out_shape=jax.ShapeDtypeStruct((b, k, rows, e), dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="opdjax_decode_attention",
  )(start_B.astype(jnp.int32), jnp.reshape(index, (1,)).astype(jnp.int32), q, layer["k"], layer["v"], *scales)
  return out[:, :, :g]
