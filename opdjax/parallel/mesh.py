"""The device mesh: `mesh.data` x `mesh.fsdp` x `mesh.tensor` over every device of every process.

Axis order is (data, fsdp, tensor) over `jax.devices()` in order, which lists each process's devices
together: batch rows, sharded over (data, fsdp), then fall into one contiguous block per process, so
a process builds only its own rows (opdjax.parallel.placement). Sizes that do not fit the devices,
the models' heads or the batch are one error naming the numbers, raised before anything compiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from opdjax.errors import UserError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # batch rows (trainer and JAX engine) are split over both


def axis_sizes(cfg, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with the -1 axis resolved; an error naming the numbers when they do not
  multiply to `num_devices`. `cfg` is the config's `mesh` section (MeshConfig)."""
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  given = "x".join(f"{n}={s}" for n, s in zip(AXES, sizes))
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise UserError(f"mesh {given}: the fixed axes ({fixed} devices) do not divide the {num_devices} devices;"
                      f" pick sizes whose product divides {num_devices}.")
    sizes[sizes.index(-1)] = num_devices // fixed
  elif fixed != num_devices:
    raise UserError(f"mesh {given} covers {fixed} devices but there are {num_devices}"
                    f" ({jax.process_count()} process(es) x {jax.local_device_count()} local devices);"
                    " make the product equal the device count, or set one axis to -1 for the rest.")
  return tuple(sizes)


def is_single_device(cfg) -> bool:
  """The default mesh (all 1): one device, the unsharded code path."""
  return (cfg.data, cfg.fsdp, cfg.tensor) == (1, 1, 1)


def make_mesh(cfg, devices: Sequence | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = axis_sizes(cfg, len(devices))
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)


def check_fits(mesh: Mesh, model_cfgs: dict, rows: dict[str, int]) -> None:
  """One error naming the numbers when the tensor axis does not divide a model's heads or MLP
  hidden, or the batch axes (and the process count) do not divide a batch. `model_cfgs`:
  {role: ModelConfig}; `rows`: {config key: number of rows}."""
  t = mesh.shape["tensor"]
  for role, mc in model_cfgs.items():
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
      n = getattr(mc, name)
      if n % t:
        raise UserError(f"mesh.tensor={t} does not divide the {role}'s {name}={n}; pick a tensor size that divides"
                        f" {role} heads ({mc.num_heads} query, {mc.num_kv_heads} key/value) and MLP hidden"
                        f" ({mc.intermediate_size}).")
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  procs = jax.process_count()
  for key, n in rows.items():
    if n % shards:
      raise UserError(f"{key}={n} is not a multiple of mesh.data x mesh.fsdp = {mesh.shape['data']} x"
                      f" {mesh.shape['fsdp']} = {shards} (batch rows are split over both); pick {key} a multiple"
                      f" of {shards}.")
    if n % procs:
      raise UserError(f"{key}={n} is not a multiple of the {procs} processes (each builds its own rows).")
