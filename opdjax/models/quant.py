"""Number formats the model and the engine compute in: FP8/INT8 rounding with absmax scales,
quantized matrices (`QArray`) and fake quantization (quantize -> dequantize in fp32).

The views apply these to params by path (opdjax.views.perturb); the decoder applies them to the KV
cache and to activations (W8A8 engines).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from opdjax.errors import UserError

FP8_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
FORMATS = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
GRANULARITIES = ("tensor", "channel", "block")
BLOCK = 128

@dataclasses.dataclass(frozen=True)
class QuantFormat:
  """`fp8_e4m3`, `fp8_e5m2` or `int8` at a scale granularity, or a plain dtype (`bf16`, `fp32`)."""

  name: str
  granularity: str = "channel"

  @classmethod
  def parse(cls, spec: str) -> QuantFormat:
    name, _, gran = spec.partition(":")
    fmt = cls(name, gran or ("tensor" if name in ("fp32", "bf16") else "channel"))
    if fmt.name not in FORMATS:
      raise UserError(f"unknown weight format {spec!r}; formats: {', '.join(FORMATS)}, optionally ':tensor',"
                      f" ':channel' or ':block' (128x128 scales), e.g. 'fp8_e4m3:block'.")
    if fmt.granularity not in GRANULARITIES:
      raise UserError(f"unknown scale granularity in {spec!r}; choose one of {', '.join(GRANULARITIES)}.")
    return fmt

  def __str__(self):
    return self.name if self.name in ("fp32", "bf16") else f"{self.name}:{self.granularity}"


def _qmax(name: str) -> float:
  return 127.0 if name == "int8" else float(jnp.finfo(FP8_DTYPES[name]).max)


def round_to_format(x_scaled: jax.Array, name: str) -> jax.Array:
  """Rounds already-scaled fp32 values to `fp8_e4m3`, `fp8_e5m2` or `int8` (saturating)."""
  qmax = _qmax(name)
  if name == "int8":
    return jnp.clip(jnp.round(x_scaled), -qmax, qmax).astype(jnp.int8)
  return jnp.clip(x_scaled, -qmax, qmax).astype(FP8_DTYPES[name])


def absmax_scale(x: jax.Array, name: str, axis=None) -> jax.Array:
  """absmax / format max over `axis`, never below the smallest normal fp32. The floor applies after
  the division: tiny / qmax is subnormal, which XLA flushes to zero, and an all-zero group would
  then divide 0 by 0. Floored, a zero group quantizes to exact zeros, and a group whose absmax is
  below qmax * tiny still never saturates. The division is a product with the reciprocal, which is
  what XLA:CPU makes of a division by a constant on some shapes only: written out, a layer's scale
  has the same bits whether it is computed alone or in a stack of layers."""
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  return jnp.maximum(amax * jnp.float32(1.0 / _qmax(name)), jnp.finfo(jnp.float32).tiny)


@flax.struct.dataclass
class QArray:
  """A matrix held quantized: `q` (fp8/int8) times `scale`; `shape` is the dequantized shape.

  `transposed`: `q` holds each `[in, out]` matrix as `[out, in]` (scales unchanged), the layout
  FP8 GEMMs read without a transpose (the contracting dimension minor on both operands)."""

  q: jax.Array
  scale: jax.Array
  shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
  transposed: bool = flax.struct.field(pytree_node=False, default=False)

  def dequantize(self) -> jax.Array:
    q = jnp.swapaxes(self.q, -1, -2) if self.transposed else self.q
    x = q.astype(jnp.float32) * self.scale
    if x.shape != self.shape:  # block layout [..., R/128, 128, C/128, 128], padded
      x = x.reshape(*x.shape[:-4], x.shape[-4] * BLOCK, x.shape[-2] * BLOCK)[..., : self.shape[-2], : self.shape[-1]]
    return x


def quantize(x: jax.Array, fmt: QuantFormat) -> QArray:
  """Scales are absmax / format max: `tensor`, one; `channel`, one per index of the last axis
  (the output channels of an `[in, out]` kernel); `block`, one per 128x128 tile (DeepSeek-V3
  style), ragged edges padded. Leading axes are a stack of matrices (the decoder's layers), each
  with its own scales: a stacked `[L, in, out]` kernel quantizes as its L matrices would alone."""
  x = x.astype(jnp.float32)
  if x.ndim < 2:
    raise UserError(f"{fmt} applies to matrices; 1-D tensors (norms, biases) stay in fp32/bf16.")
  if fmt.granularity == "block":
    rows, cols = x.shape[-2:]
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, -rows % BLOCK), (0, -cols % BLOCK)])
    x_t = xp.reshape(*x.shape[:-2], xp.shape[-2] // BLOCK, BLOCK, xp.shape[-1] // BLOCK, BLOCK)
    scale = absmax_scale(x_t, fmt.name, axis=(-3, -1))
  else:
    x_t = x
    scale = absmax_scale(x, fmt.name, axis=(-2, -1) if fmt.granularity == "tensor" else -2)
  return QArray(round_to_format(x_t / scale, fmt.name), scale, tuple(x.shape))


def fake_quant(x: jax.Array, fmt: QuantFormat) -> jax.Array:
  """Quantize then dequantize: fp32 values exactly representable in the quantized form."""
  if fmt.name == "fp32":
    return x.astype(jnp.float32)
  if fmt.name == "bf16":
    return x.astype(jnp.bfloat16).astype(jnp.float32)
  return quantize(x, fmt).dequantize()


def fp8_matmul_ready(x) -> bool:
  """A packed e4m3 matrix with per-tensor or per-channel scales: `fp8_dot` can multiply it."""
  return (isinstance(x, QArray) and x.q.dtype == jnp.float8_e4m3fn and x.q.ndim == len(x.shape)
          and x.scale.shape[-2] == 1)


def unpack(params):
  """Dequantizes every `QArray` leaf."""
  return jax.tree.map(lambda x: x.dequantize() if isinstance(x, QArray) else x, params,
                      is_leaf=lambda x: isinstance(x, QArray))


def fp8_dot(x: jax.Array, w: QArray) -> jax.Array:
  """`x [..., in] @ w` with both operands fp8 on the dot: x rounded to e4m3 with a per-token
  absmax scale (as `act_quant="fp8_e4m3"` rounds it), fp32 accumulation, and the two scales
  applied to the fp32 product. Mathematically the fake-quant product; only the rounding of the
  sum differs. `w` is one layer's slice: `q [in, out]` (`[out, in]` when transposed) and
  `scale [1, out]` or `[1, 1]`."""
  x32 = x.astype(jnp.float32)
  sx = absmax_scale(x32, "fp8_e4m3", axis=-1)
  xq = round_to_format(x32 / sx, "fp8_e4m3")
  contract = 1 if w.transposed else 0
  y = jax.lax.dot_general(xq, w.q, (((x.ndim - 1,), (contract,)), ((), ())), preferred_element_type=jnp.float32)
  return y * sx * w.scale


# FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later.
FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_support(device) -> None:
  """One error when `fp8_matmul` is asked of a GPU without FP8 tensor cores (compute capability
  below 8.9); CPUs and TPUs pass (XLA upcasts where the hardware has no fp8 units)."""
  if device.platform != "gpu":
    return
  cap = str(getattr(device, "compute_capability", "") or "")
  try:
    have = tuple(int(p) for p in cap.split(".")[:2])
  except ValueError:
    have = ()
  if len(have) == 2 and have >= FP8_MIN_CAPABILITY:
    return
  need = ".".join(map(str, FP8_MIN_CAPABILITY))
  raise UserError(
      f"fp8_matmul needs a GPU of compute capability >= {need} (FP8 tensor cores: Ada, Hopper or newer);"
      f" {getattr(device, 'device_kind', 'this GPU')} has compute capability {cap or 'unknown'}. Turn"
      " fp8_matmul off: packed fp8 weights are then dequantized to the compute dtype before each matmul.")
