"""Partition rules: every sharding choice for params, optimizer state, batches and the KV cache.

A parameter's path is its module path as in opdjax.paths with the leaf name appended and
the stacked layer axis written `*` (`layers.*.mlp.down_proj.kernel`, `embed_tokens.embedding`);
`RULES` maps shell patterns of it to a PartitionSpec of ONE layer's tensor (the stacked `[L]` axis
is never sharded: the layer scan slices it). First match wins.

`tensor` goes on attention heads and the MLP hidden (Megatron: q/k/v and gate/up split their
outputs, o/down their inputs, so each device's heads and hidden units are its own). `fsdp` goes on
the other (model-width) dim; where the fsdp size does not divide that dim it moves to the largest
dim it divides, and a tensor no dim of which it divides stays replicated over fsdp (tiny norms of
toy models). Optimizer state leaves take the spec of the param they mirror.
"""

from __future__ import annotations

import fnmatch

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.errors import UserError
from opdjax.parallel.mesh import BATCH_AXES
from opdjax.paths import STACKED, module_path

RULES: tuple[tuple[str, P], ...] = (
    ("layers.*.self_attn.[qkv]_proj.kernel", P("fsdp", "tensor")),  # [D, heads * E]
    ("layers.*.self_attn.[qkv]_proj.bias", P("tensor")),
    ("layers.*.self_attn.o_proj.kernel", P("tensor", "fsdp")),  # [heads * E, D]
    ("layers.*.mlp.gate_proj.kernel", P("fsdp", "tensor")),  # [D, F]
    ("layers.*.mlp.up_proj.kernel", P("fsdp", "tensor")),
    ("layers.*.mlp.gate_proj.bias", P("tensor")),
    ("layers.*.mlp.up_proj.bias", P("tensor")),
    ("layers.*.mlp.down_proj.kernel", P("tensor", "fsdp")),  # [F, D]
    ("embed_tokens.embedding", P("fsdp", None)),  # [V, D]
    ("lm_head.kernel", P(None, "fsdp")),  # [D, V]
    ("*", P("fsdp")),  # norms, q/k norms, o/down biases: FSDP on the largest dim
)

BATCH = P(BATCH_AXES)  # rows over (data, fsdp), every other dim whole
KV_CACHE = P(BATCH_AXES, "tensor", None, None)  # one layer's keys or values [B, K, S, E]
KV_SCALE = P(BATCH_AXES, "tensor", None)  # their fp8 scales [B, K, S]


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def param_path(keys: tuple[str, ...]) -> str:
  """('layers', 'mlp', 'down_proj', 'kernel') -> 'layers.*.mlp.down_proj.kernel'."""
  return f"{module_path(keys, '*')}.{keys[-1]}" if len(keys) > 1 else keys[0]


def rule_for(path: str) -> P:
  for pattern, spec in RULES:
    if fnmatch.fnmatchcase(path, pattern):
      return spec
  raise UserError(f"no partition rule matches {path!r}")  # unreachable while RULES ends with '*'


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, stacked: bool) -> P:
  """The PartitionSpec of a whole leaf (stacked axis included) on `mesh`."""
  dims = shape[1:] if stacked else shape
  rule = tuple(rule_for(path)) + (None,) * len(dims)
  out: list = [None] * len(dims)
  for i, (axis, n) in enumerate(zip(rule, dims)):
    if axis == "tensor" and mesh.shape["tensor"] > 1:
      if n % mesh.shape["tensor"]:
        raise UserError(f"mesh.tensor={mesh.shape['tensor']} does not divide dim {i + stacked} ({n}) of {path} {shape};"
                        " pick a tensor size that divides the heads and the MLP hidden.")
      out[i] = "tensor"
  f = mesh.shape["fsdp"]
  if f > 1 and "fsdp" in rule[:len(dims)]:
    want = rule.index("fsdp")
    free = [i for i in range(len(dims)) if out[i] is None and dims[i] % f == 0]
    if free:
      out[want if want in free else max(free, key=lambda i: dims[i])] = "fsdp"
  return P(*([None] if stacked else []), *out)


def param_specs(params, mesh: Mesh):
  """The params' tree of PartitionSpecs (works on arrays and on `jax.eval_shape` structs)."""
  def one(path, x):
    keys = _keys(path)
    return spec_for(param_path(keys), tuple(x.shape), mesh, keys[0] == STACKED)

  return jax.tree_util.tree_map_with_path(one, params)


def param_shardings(params, mesh: Mesh):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh))


def mirrored_shardings(tree, params, mesh: Mesh):
  """Shardings of a tree whose leaves mirror params (optimizer moments, a TrainState): a leaf takes
  the spec of the param whose key path ends its own path with the same shape; anything else
  (step counters, schedules' counts) is replicated."""
  specs = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = _keys(path)
    specs[keys] = (tuple(x.shape), spec_for(param_path(keys), tuple(x.shape), mesh, keys[0] == STACKED))

  def one(path, x):
    keys = _keys(path)
    for i in range(len(keys)):
      hit = specs.get(keys[i:])
      if hit is not None and hit[0] == tuple(x.shape):
        return NamedSharding(mesh, hit[1])
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(one, tree)


def rows_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Rows over the batch axes for a `[B, ...]` array of `ndim` dims."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def kv_cache_shardings(cache, mesh: Mesh):
  """The engine's KV cache (opdjax.models.kv_cache) sharded: each layer's buffers rows over the
  batch axes and kv heads over tensor, the write index replicated."""
  spec = {0: P(), 3: KV_SCALE, 4: KV_CACHE}
  return jax.tree.map(lambda x: NamedSharding(mesh, spec[len(x.shape)]), cache)
