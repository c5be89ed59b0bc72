"""Functional perturbations of a params pytree by path: quantization recipes and weight noise.

Each is a pure `params -> params` transform (gemma's quantization shape), seeded where random,
and selectable by parameter path. A path is the dotted module name of a tensor:
`embed_tokens`, `layers.3.self_attn.q_proj`, `layers.0.mlp.down_proj`, `norm`, `lm_head`; patterns
are shell-style (`fnmatch`): `layers.3.mlp.*`, `*.self_attn.*`, `*_proj`. A pattern that matches
nothing is an error, so a typo never silently perturbs nothing.

The decoder keeps its layers' params stacked (`params["layers"]["mlp"]["down_proj"]["kernel"]` is
`[L, in, out]`); here each layer's slice is its own tensor `layers.{i}.mlp.down_proj`, so a
per-layer pattern perturbs only its slices and every other slice stays bit-identical.

Quantization here is "fake" (quantize -> dequantize in fp32): the numerics of FP8/INT8 weights,
which is what the rollout/trainer mismatch depends on. Memory savings are the capacity planner's
business, not this module's.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.errors import UserError
from opdjax.models.quant import QuantFormat, fake_quant, quantize
from opdjax.paths import STACKED, module_path

# --- paths -------------------------------------------------------------------------------------

def _keys(path) -> tuple[str, ...]:
  return tuple(getattr(p, "key", str(p)) for p in path)


def _slice_paths(keys: Sequence[str], x) -> list[str]:
  """Module paths of a leaf's tensors: one per layer for a stacked leaf, else the one."""
  if keys[0] == STACKED:
    return [module_path(keys, i) for i in range(x.shape[0])]
  return [module_path(keys)]


def _layer_slice(x, i: int):
  if isinstance(x, jax.ShapeDtypeStruct):  # abstract params (`jax.eval_shape`) have no values to index
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return x[i]


def named_leaves(params) -> list[tuple[str, str, jax.Array]]:
  """[(module path, leaf name, array)] in tree order; a stacked leaf gives one entry per layer."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = _keys(path)
    paths = _slice_paths(keys, x)
    if keys[0] == STACKED:
      out += [(m, keys[-1], _layer_slice(x, i)) for i, m in enumerate(paths)]
    else:
      out.append((paths[0], keys[-1], x))
  return out


def _tensor_names(params) -> list[tuple[str, str]]:
  """(module path, leaf name) of `named_leaves`, without slicing anything."""
  return [(m, _keys(path)[-1]) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
          for m in _slice_paths(_keys(path), x)]


def match(pattern: str, params) -> list[str]:
  """Module paths matching `pattern`; an error naming examples when there are none."""
  paths = sorted({m for m, _ in _tensor_names(params)})
  hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
  if not hits:
    raise UserError(f"parameter pattern {pattern!r} matches nothing; paths look like "
                    f"{', '.join(paths[:3])}, ..., {paths[-1]} (shell patterns: '*.self_attn.*', 'layers.3.mlp.*').")
  return hits


def _groups(paths: Sequence[str], group_of: Callable[[str], object]) -> dict[object, list[int]]:
  """{group: slice indices} over a leaf's slice paths; a group of None is left out (untouched)."""
  out: dict[object, list[int]] = {}
  for i, m in enumerate(paths):
    g = group_of(m)
    if g is not None:
      out.setdefault(g, []).append(i)
  return out


def _update_slices(keys: Sequence[str], x, groups: dict[object, list[int]], fn: Callable):
  """`x` with each group's slices replaced by `fn(group, indices, slices [n, ...])`. Slices of no
  group keep their values; a leaf whose every slice is in one group is mapped whole (no gather)."""
  if not groups:
    return x  # the same array object: untouched leaves cost nothing
  stacked = keys[0] == STACKED
  xs = x if stacked else x[None]
  for g, idx in groups.items():
    if len(idx) == xs.shape[0]:
      xs = fn(g, idx, xs)
    else:
      at = np.asarray(idx)
      ys = fn(g, idx, xs[at])
      xs = xs.astype(ys.dtype).at[at].set(ys)
  return xs if stacked else xs[0]


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
  returned as `QArray`s (real fp8/int8 storage plus scales) instead of dequantized fp32; a stacked
  leaf packs only when all its layers get the same format (one `QArray` holds one format), else it
  stays fake-quantized fp32 with the same values.
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
    paths = _slice_paths(keys, x)
    groups = _groups(paths, lambda m: next((f for pat, f in rows if fnmatch.fnmatchcase(m, pat)), None))
    matrix = x.ndim - (keys[0] == STACKED) >= 2
    if pack and matrix and len(groups) == 1:
      [(fmt, idx)] = groups.items()
      if len(idx) == len(paths) and fmt.name not in ("fp32", "bf16"):
        return quantize(x, fmt)  # stacked: per-layer scales, the numbers each layer would get alone

    def rounded(fmt, _, xs):
      if not matrix:
        return fake_quant(xs, QuantFormat("bf16")) if fmt.name != "fp32" else xs
      return fake_quant(xs, fmt)

    return _update_slices(keys, x, groups, rounded)

  return jax.tree_util.tree_map_with_path(visit, params)


# --- noise -------------------------------------------------------------------------------------

def add_weight_noise(params, key: jax.Array, sigma: float, patterns: Sequence[str] | None = None,
                     layer_scale: Callable[[str], float] | None = None):
  """x + sigma * rms(x) * N(0, 1) on every selected matrix, seeded by `key`.

  `layer_scale(module_path)` multiplies sigma per tensor (e.g. more noise in deeper layers). Each
  tensor (each layer's slice of a stacked leaf, with its own rms) gets its noise from
  `fold_in(key, index)`, its index in `named_leaves`, so selecting fewer tensors or layers does not
  change the noise the others get.
  """
  selected = None if patterns is None else {p for pat in patterns for p in match(pat, params)}
  index = {name: i for i, name in enumerate(_tensor_names(params))}

  def visit(path, x):
    keys = _keys(path)
    paths = _slice_paths(keys, x)
    picked = [i for i, m in enumerate(paths) if selected is None or m in selected]
    if keys[-1] not in ("kernel", "embedding") or not picked:
      return x
    stacked = keys[0] == STACKED
    xs = x if stacked else x[None]
    x32 = xs.astype(jnp.float32)
    # Each slice's rms is reduced over the whole stack at once, so its bits never depend on which
    # other slices are selected (a reduction over a differently shaped gather may round differently).
    rms = jnp.sqrt(jnp.mean(jnp.square(x32), axis=tuple(range(1, xs.ndim))))
    at = np.asarray(picked)
    ids = jnp.asarray([index[(paths[i], keys[-1])] for i in picked], jnp.uint32)
    scales = jnp.asarray([1.0 if layer_scale is None else layer_scale(paths[i]) for i in picked], jnp.float32)
    eps = jax.vmap(lambda k: jax.random.normal(k, xs.shape[1:], jnp.float32))(
        jax.vmap(jax.random.fold_in, (None, 0))(key, ids))
    step = (sigma * scales * rms[at]).reshape((-1,) + (1,) * (xs.ndim - 1))
    if len(picked) == len(paths):
      ys = (x32 + step * eps).astype(x.dtype)
    else:
      ys = xs.at[at].set((x32[at] + step * eps).astype(x.dtype))
    return ys if stacked else ys[0]

  return jax.tree_util.tree_map_with_path(visit, params)
