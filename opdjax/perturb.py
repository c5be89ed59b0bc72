"""Functional perturbations of a params pytree: quantization, weight noise, staleness.

Each is a pure `params -> params` transform (gemma's quantization shape), seeded where random,
and selectable by parameter path. A path is the dotted module name of a tensor:
`embed_tokens`, `layers.3.self_attn.q_proj`, `layers.0.mlp.down_proj`, `norm`, `lm_head`; patterns
are shell-style (`fnmatch`): `layers.3.mlp.*`, `*.self_attn.*`, `*_proj`. A pattern that matches
nothing is an error, so a typo never silently perturbs nothing.

Quantization here is "fake" (quantize -> dequantize in fp32): the numerics of FP8/INT8 weights,
which is what the rollout/trainer mismatch depends on. Memory savings are the capacity planner's
business, not this module's.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import re
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from opdjax.errors import UserError

FP8_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
FORMATS = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
GRANULARITIES = ("tensor", "channel", "block")
BLOCK = 128


# --- paths -------------------------------------------------------------------------------------

def module_path(keys: Sequence[str]) -> str:
  """('layers_3', 'mlp', 'down_proj', 'kernel') -> 'layers.3.mlp.down_proj'."""
  mods = [re.sub(r"^layers_(\d+)$", r"layers.\1", k) for k in keys[:-1]]
  return ".".join(mods)


def _keys(path) -> tuple[str, ...]:
  return tuple(getattr(p, "key", str(p)) for p in path)


def named_leaves(params) -> list[tuple[str, str, jax.Array]]:
  """[(module path, leaf name, array)] in tree order."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = _keys(path)
    out.append((module_path(keys), keys[-1], x))
  return out


def match(pattern: str, params) -> list[str]:
  """Module paths matching `pattern`; an error naming examples when there are none."""
  paths = sorted({m for m, _, _ in named_leaves(params)})
  hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
  if not hits:
    raise UserError(f"parameter pattern {pattern!r} matches nothing; paths look like "
                    f"{', '.join(paths[:3])}, ..., {paths[-1]} (shell patterns: '*.self_attn.*', 'layers.3.mlp.*').")
  return hits


def map_selected(fn: Callable, params, patterns: Sequence[str] | None, leaves: Sequence[str] = ("kernel", "embedding")):
  """Applies `fn(path, x)` to the leaves named in `leaves` of modules matching any pattern."""
  selected = None if patterns is None else {p for pat in patterns for p in match(pat, params)}

  def visit(path, x):
    keys = _keys(path)
    mod = module_path(keys)
    if keys[-1] in leaves and (selected is None or mod in selected):
      return fn(mod, x)
    return x

  return jax.tree_util.tree_map_with_path(visit, params)


# --- quantization ------------------------------------------------------------------------------

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
  return jnp.maximum(jnp.max(jnp.abs(x), axis=axis, keepdims=True), jnp.finfo(jnp.float32).tiny) / _qmax(name)


@flax.struct.dataclass
class QArray:
  """A matrix held quantized: `q` (fp8/int8) times `scale`; `shape` is the dequantized shape."""

  q: jax.Array
  scale: jax.Array
  shape: tuple[int, ...] = flax.struct.field(pytree_node=False)

  def dequantize(self) -> jax.Array:
    x = self.q.astype(jnp.float32) * self.scale
    if x.shape != self.shape:  # block layout [..., R/128, 128, C/128, 128], padded
      x = x.reshape(*x.shape[:-4], x.shape[-4] * BLOCK, x.shape[-2] * BLOCK)[..., : self.shape[-2], : self.shape[-1]]
    return x


def quantize(x: jax.Array, fmt: QuantFormat) -> QArray:
  """Scales are absmax / format max: `tensor`, one; `channel`, one per index of the last axis
  (the output channels of an `[in, out]` kernel); `block`, one per 128x128 tile (DeepSeek-V3
  style), ragged edges padded."""
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
    scale = absmax_scale(x, fmt.name, axis=None if fmt.granularity == "tensor" else -2)
  return QArray(round_to_format(x_t / scale, fmt.name), scale, tuple(x.shape))


def fake_quant(x: jax.Array, fmt: QuantFormat) -> jax.Array:
  """Quantize then dequantize: fp32 values exactly representable in the quantized form."""
  if fmt.name == "fp32":
    return x.astype(jnp.float32)
  if fmt.name == "bf16":
    return x.astype(jnp.bfloat16).astype(jnp.float32)
  return quantize(x, fmt).dequantize()


def unpack(params):
  """Dequantizes every `QArray` leaf (call inside jit: XLA fuses it into the consumers)."""
  return jax.tree.map(lambda x: x.dequantize() if isinstance(x, QArray) else x, params,
                      is_leaf=lambda x: isinstance(x, QArray))


# Presets: ordered (pattern -> format); first match wins; unmatched tensors stay fp32.
def preset(name: str, num_layers: int, keep_edge_layers: int = 1) -> list[tuple[str, str]]:
  """Common practice: embeddings, lm_head (and norms, always) kept in bf16; the first/last
  `keep_edge_layers` layers kept in bf16; every other projection in the named format."""
  formats = {"fp8": "fp8_e4m3:channel", "fp8_block": "fp8_e4m3:block", "fp8_e5m2": "fp8_e5m2:channel",
             "int8": "int8:channel", "bf16": "bf16"}
  if name not in formats:
    raise UserError(f"unknown recipe preset {name!r}; presets: {', '.join(formats)}.")
  recipe = [("embed_tokens", "bf16"), ("lm_head", "bf16")]
  edges = sorted(set(range(min(keep_edge_layers, num_layers))) |
                 set(range(max(num_layers - keep_edge_layers, 0), num_layers)))
  recipe += [(f"layers.{i}.*", "bf16") for i in edges]
  return recipe + [("*", formats[name])]


def parse_recipe(spec: str) -> list[tuple[str, str]]:
  """`"layers.0.*>bf16|*>fp8_e4m3:channel"` -> [(pattern, format), ...] (formats checked)."""
  rows = []
  for row in spec.split("|"):
    pat, sep, fmt = row.partition(">")
    if not sep or not pat.strip() or not fmt.strip():
      raise UserError(f"recipe row {row!r} in {spec!r} is not 'pattern>format' (e.g. 'layers.0.*>bf16|*>fp8_e4m3').")
    QuantFormat.parse(fmt.strip())
    rows.append((pat.strip(), fmt.strip()))
  return rows


def apply_recipe(params, recipe: Sequence[tuple[str, str]], pack: bool = False):
  """Quantizes each matrix by the first (pattern -> format) row whose pattern matches its path.

  Norm weights and biases are rounded to bf16 whenever their module falls under any recipe row
  (inference engines keep them in bf16), never to FP8/INT8. With `pack`, FP8/INT8 matrices are
  returned as `QArray`s (real fp8/int8 storage plus scales) instead of dequantized fp32.
  """
  rows = [(pat, QuantFormat.parse(spec)) for pat, spec in recipe]
  if "lm_head" not in params and "embed_tokens" in params:  # tied: the head is the embedding matrix
    embed = next((f for pat, f in rows if fnmatch.fnmatchcase("embed_tokens", pat)), None)
    for pat, f in rows:
      if pat == "lm_head" and f != embed:
        raise UserError(f"recipe row lm_head>{f}: this model ties lm_head to embed_tokens (which gets {embed});"
                        " give both the same format or drop the lm_head row.")
    rows = [(pat, f) for pat, f in rows if pat != "lm_head"]
  for pat, _ in rows:
    match(pat, params)  # every pattern must select something

  def visit(path, x):
    keys = _keys(path)
    mod = module_path(keys)
    fmt = next((f for pat, f in rows if fnmatch.fnmatchcase(mod, pat)), None)
    if fmt is None:
      return x
    if x.ndim < 2:
      return fake_quant(x, QuantFormat("bf16")) if fmt.name != "fp32" else x
    if pack and fmt.name not in ("fp32", "bf16"):
      return quantize(x, fmt)
    return fake_quant(x, fmt)

  return jax.tree_util.tree_map_with_path(visit, params)


# --- noise -------------------------------------------------------------------------------------

def add_weight_noise(params, key: jax.Array, sigma: float, patterns: Sequence[str] | None = None,
                     layer_scale: Callable[[str], float] | None = None):
  """x + sigma * rms(x) * N(0, 1) on every selected matrix, seeded by `key`.

  `layer_scale(module_path)` multiplies sigma per tensor (e.g. more noise in deeper layers).
  Each tensor's noise comes from `fold_in(key, index)`, so selecting fewer tensors does not
  change the noise the others get.
  """
  index = {m: i for i, (m, _, _) in enumerate(named_leaves(params))}

  def noisy(mod, x):
    s = sigma * (1.0 if layer_scale is None else layer_scale(mod))
    rms = jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))
    eps = jax.random.normal(jax.random.fold_in(key, index[mod]), x.shape, jnp.float32)
    return (x.astype(jnp.float32) + s * rms * eps).astype(x.dtype)

  return map_selected(noisy, params, patterns)


# --- staleness ---------------------------------------------------------------------------------

class ParamsHistory:
  """The last `maxlen` params versions, so an engine can sample with params exactly k steps old.

  Versions are copied in (the train step donates its state), so the buffer costs `maxlen`
  copies of the params.
  """

  def __init__(self, maxlen: int):
    if maxlen < 1:
      raise UserError(f"staleness buffer needs maxlen >= 1, got {maxlen}.")
    self._buf: collections.deque[tuple[int, object]] = collections.deque(maxlen=maxlen)

  def push(self, version: int, params) -> None:
    self._buf.append((version, jax.tree.map(jnp.copy, params)))

  def lagged(self, lag: int) -> tuple[int, object]:
    """(version, params) from `lag` pushes ago; the oldest kept one while fewer exist."""
    if not self._buf:
      raise UserError("staleness buffer is empty: push the initial params first.")
    if lag >= self._buf.maxlen:
      raise UserError(f"lag {lag} needs a buffer of at least {lag + 1} versions (have maxlen={self._buf.maxlen}).")
    return self._buf[max(len(self._buf) - 1 - lag, 0)]

  def params(self) -> list:
    """The kept versions' params, oldest first (what a checkpoint saves)."""
    return [p for _, p in self._buf]

  def __len__(self):
    return len(self._buf)

  @property
  def versions(self) -> list[int]:
    return [v for v, _ in self._buf]
