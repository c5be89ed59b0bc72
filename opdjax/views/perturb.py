"""Functional perturbations of a params pytree by path: quantization recipes and weight noise.

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

import fnmatch
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from opdjax.errors import UserError
from opdjax.models.quant import QuantFormat, fake_quant, quantize

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
