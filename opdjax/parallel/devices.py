"""One host, two meshes: which of this host's devices the asynchronous JAX engine samples on
(`rollout.devices`) and which the trainer's mesh covers (the rest).

`rollout.devices` is a count ('2': the last two of this host's devices) or a set of indices into
`jax.local_devices()` ('2,3'; one device: '3,'). The trainer's mesh (`mesh.*`) is built over the
devices the engine leaves; the engine gets its own mesh over its devices (the trainer's shape when
it has as many devices, else FSDP over them, keeping the trainer's tensor axis where it divides),
so its rows, weights and KV cache are sharded by the same partition rules (opdjax.parallel.rules).
Across processes the JAX engine cannot sit apart from the trainer (one multi-controller program
spans every process's devices): there the asynchronous engine is vLLM.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from opdjax.errors import UserError
from opdjax.parallel.mesh import AXES, check_fits, is_single_device

NO_DEVICES = ("rollout.async_depth={depth} with the JAX engine and a trainer sharded over a mesh (mesh.*): give the"
              " engine its own devices with rollout.devices, a count (e.g. '2': the last two of this host's {n}) or a"
              " set (e.g. '2,3'); the trainer's mesh is built over the rest.")


def parse(spec: str) -> tuple[str, tuple[int, ...]]:
  """'2' -> ('count', (2,)); '2,3' -> ('set', (2, 3)); '3,' -> ('set', (3,))."""
  parts = [p.strip() for p in spec.split(",")]
  if "," not in spec:
    if not spec.strip().isdigit():
      raise UserError(f"rollout.devices={spec!r}: give a count (e.g. '2': the last two devices of this host) or a"
                      " set of device indices (e.g. '2,3'; one device: '3,').")
    return "count", (int(spec),)
  idx = [p for p in parts if p]
  if not idx or not all(p.isdigit() for p in idx) or len(set(idx)) != len(idx):
    raise UserError(f"rollout.devices={spec!r}: a set lists distinct device indices, e.g. '2,3' (one device: '3,').")
  return "set", tuple(int(p) for p in idx)


def more_devices(platform: str, need: int) -> str:
  """How to give this process `need` devices of `platform`."""
  if platform == "cpu":
    return (f"on CPU, start it with XLA_FLAGS=--xla_force_host_platform_device_count={need} (or"
            f" JAX_NUM_CPU_DEVICES={need}) in its environment")
  if platform in ("gpu", "cuda", "rocm"):
    return (f"on GPU, make {need} GPUs visible to it (CUDA_VISIBLE_DEVICES, when set, lists the ones it sees), on a"
            f" host that has {need}")
  return f"run it on a host with {need} {platform} devices"


def engine_devices(spec: str, local: list | None = None) -> list:
  """The devices `rollout.devices` names, out of this host's `local` devices."""
  local = list(jax.local_devices() if local is None else local)
  kind, vals = parse(spec)
  platform = local[0].platform
  if kind == "count":
    n = vals[0]
    if n < 1:
      raise UserError(f"rollout.devices={spec!r}: give the JAX engine a count of at least 1 device (or leave"
                      " rollout.devices empty).")
    if n > len(local) or len(local) == 1:  # (a count of all of two or more devices: `split` names the fix)
      fewer = f", or ask for fewer (rollout.devices from 1 to {len(local) - 1})" if len(local) > 1 else ""
      raise UserError(f"rollout.devices={spec!r} asks for {n} device(s) for the JAX engine and the trainer needs one"
                      f" more, but this host has {len(local)} {platform} device(s): too few. Give the process"
                      f" {n + 1}: {more_devices(platform, n + 1)}{fewer}.")
    return local[len(local) - n:]
  missing = [i for i in vals if i >= len(local)]
  if missing:
    raise UserError(f"rollout.devices={spec!r} names device(s) {', '.join(map(str, missing))}, which this host"
                    f" lacks: it has {len(local)} {platform} device(s), indices 0..{len(local) - 1}. Give the process"
                    f" {max(vals) + 1}: {more_devices(platform, max(vals) + 1)}.")
  return [local[i] for i in vals]


def _indices(devs, local) -> str:
  return ",".join(str(local.index(d)) for d in devs)


def split(rcfg, mesh_cfg, *, own_engine_devices: bool) -> tuple[list | None, list | None]:
  """(the devices the trainer's mesh is built over, the asynchronous JAX engine's devices): this
  host's devices the engine leaves, when an asynchronous run gives it its own (`rollout.devices`);
  None: every device (the usual mesh) / not chosen here. `own_engine_devices`: the run has an
  asynchronous engine in this process (opdjax.rollout.deploy decides). Checked before anything is
  written: an engine set that leaves the trainer nothing, names devices this host lacks, or overlaps
  the trainer's mesh; the JAX engine behind a multi-process trainer."""
  if not own_engine_devices:
    return None, None
  if jax.process_count() > 1:
    raise UserError(f"rollout.async_depth={rcfg.async_depth} with the JAX engine and {jax.process_count()} trainer"
                    " processes: the JAX engine cannot sample on devices apart from a trainer whose one program spans"
                    " every process's devices. Use vLLM sidecars (rollout.engine=vllm, rollout.vllm.num_servers or"
                    " rollout.vllm.urls), or rollout.async_depth=0.")
  if not rcfg.devices:
    if not is_single_device(mesh_cfg):
      raise UserError(NO_DEVICES.format(depth=rcfg.async_depth, n=jax.local_device_count()))
    return None, None
  local = jax.local_devices()
  engine = engine_devices(rcfg.devices, local)
  rest = [d for d in local if d not in engine]
  if not rest:
    raise UserError(f"rollout.devices={rcfg.devices!r} gives the JAX engine every one of this host's {len(local)}"
                    f" devices and leaves the trainer none: give the engine at most {len(local) - 1}, e.g."
                    f" rollout.devices={len(local) // 2 or 1}.")
  sizes = (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
  if is_single_device(mesh_cfg):
    if local[0] in engine:
      raise UserError(f"rollout.devices={rcfg.devices!r} overlaps the trainer: the one-device trainer (the default"
                      f" mesh) trains on device 0. Give the engine devices from 1 to {len(local) - 1} (e.g."
                      f" rollout.devices={len(local) - 1}), or a mesh over the rest (e.g. mesh.fsdp=-1).")
    return None, engine
  given = "x".join(f"{a}={s}" for a, s in zip(AXES, sizes))
  fixed = int(np.prod([s for s in sizes if s != -1]))
  if (-1 not in sizes and fixed != len(rest)) or (-1 in sizes and len(rest) % fixed):
    what = "overlaps the trainer's mesh" if fixed > len(rest) else "leaves devices neither side uses"
    raise UserError(f"rollout.devices={rcfg.devices!r} {what}: the JAX engine takes devices {_indices(engine, local)}"
                    f" of this host's {len(local)}, the trainer's mesh is built over the {len(rest)} left"
                    f" ({_indices(rest, local)}), and mesh {given} covers {fixed}. Make the mesh cover {len(rest)}"
                    " devices (e.g. mesh.fsdp=-1), or change rollout.devices.")
  return rest, engine


def engine_mesh(devices: list, trainer_mesh: Mesh | None, model_cfg, batch: int) -> Mesh | None:
  """The JAX engine's own mesh over `devices` (None for one device: the unsharded engine). The
  trainer's shape when the engine has as many devices (so an asynchronous run samples exactly as
  the synchronous run on that mesh does), else FSDP over them, with the trainer's tensor axis where
  it divides the count and the model's heads."""
  if len(devices) == 1:
    return None
  n = len(devices)
  if trainer_mesh is not None and trainer_mesh.size == n:
    shape = tuple(trainer_mesh.shape[a] for a in AXES)
  else:
    t = trainer_mesh.shape["tensor"] if trainer_mesh is not None else 1
    if n % t or model_cfg.num_kv_heads % t or model_cfg.num_heads % t or model_cfg.intermediate_size % t:
      t = 1
    shape = (1, n // t, t)
  mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)
  try:
    check_fits(mesh, {"student": model_cfg}, {"rollout.batch_size": batch})
  except UserError as e:
    raise UserError(f"the JAX engine's mesh over its {n} devices (rollout.devices), data={shape[0]} fsdp={shape[1]}"
                    f" tensor={shape[2]}: {e}") from None
  return mesh


def describe_engine(devices: list, mesh: Mesh | None) -> str:
  local = jax.local_devices()
  where = f"device(s) {_indices(devices, local)}"
  if mesh is None:
    return f"the JAX engine samples on {where}, unsharded"
  return f"the JAX engine samples on {where}, its own mesh " + " ".join(f"{k}={v}" for k, v in mesh.shape.items())

