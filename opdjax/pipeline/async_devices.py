"""Where the asynchronous producer's JAX engine samples (`rollout.devices`: its own device, or its
own mesh beside the trainer's) and whether the versions it keeps fit there: the start-up checks
`opdjax train` runs before it writes anything (opdjax.pipeline.async_sampler uses them)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from opdjax.errors import UserError
from opdjax.parallel.devices import NO_DEVICES, engine_devices
from opdjax.parallel.placement import Placement
from opdjax.parallel.rules import param_shardings
from opdjax.pipeline.session import Session
from opdjax.views.view import EngineView


def free_bytes(device) -> int | None:
  """Free memory of `device` in bytes, None where the runtime does not report it (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 -- not every runtime implements it
    return None
  if not stats or "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


@dataclasses.dataclass
class EngineSide:
  """Where the producer's JAX engine samples: `devices` (its own), `placement` (its own mesh over
  them; None for one device: the unsharded engine under `jax.default_device`)."""

  devices: list
  placement: Placement | None

  @property
  def device(self):
    return self.devices[0]

  @property
  def key(self):
    """EnginePool's key of its engines."""
    return self.placement if self.placement is not None else self.device

  def shardings(self, params):
    if self.placement is not None:
      return param_shardings(params, self.placement.mesh)
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(self.device), params)


def engine_side(session: Session, spec: str) -> EngineSide | None:
  """The JAX engine's devices for `rollout.devices=spec` (None for vLLM: it samples in its own
  processes), checked against the trainer's: they may not overlap it, nor be missing on this host."""
  if session.cfg.rollout.engine != "jax":
    return None
  if session.cfg.rollout.placement == "disaggregated":
    # The JAX engine in a process of its own (opdjax.rollout.jax_sidecar): its export copies each
    # version to host memory, so the producer needs no device of this process (a device copy onto
    # one would be a second copy of every version, on the trainer's cores).
    return None
  trainer = session.placement.devices or [jax.devices()[0]]
  local = jax.local_devices(backend=trainer[0].platform)
  if not spec:
    if session.placement.sharded:
      raise UserError(NO_DEVICES.format(depth=session.cfg.rollout.async_depth or "k", n=len(local)))
    others = [d for d in local if d not in trainer]
    return EngineSide([others[-1] if others else trainer[0]], None)
  devices = engine_devices(spec, local)
  shared = [local.index(d) for d in devices if d in trainer]
  if shared:
    free = [str(i) for i, d in enumerate(local) if d not in trainer]
    what = "the trainer's device" if len(trainer) == 1 else "the trainer's mesh"
    raise UserError(f"rollout.devices={spec!r} overlaps {what} (device(s) {', '.join(map(str, shared))}); the JAX"
                    " engine needs devices of its own to sample while the trainer trains: give it devices out of"
                    f" {','.join(free) or 'none (every device is the trainer s)'}, or build the trainer's mesh over"
                    " the rest (rollout.devices in the run's config).")
  if len(devices) == 1:
    return EngineSide(devices, None)
  return EngineSide(devices, Placement.engine(devices, session.placement, session.student.cfg,
                                              session.cfg.rollout.batch_size))


def check_memory(side: EngineSide | None, params, depth: int, view: EngineView) -> None:
  """Exact mode keeps depth + 1 versions on the engine's devices (and their transformed copies, for
  views with noise or quantization), plus the engine's own installed copy."""
  if side is None:
    return
  frees = [free_bytes(d) for d in side.devices]
  if any(f is None for f in frees):
    return
  shardings = side.shardings(params)
  per_device = sum(math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))
  copies = (depth + 1) * (1 if view == EngineView(lag=view.lag) else 2) + 1
  free = min(frees)
  if copies * per_device > free:
    raise UserError(f"rollout.async_depth={depth} keeps {copies} params copies ({copies * per_device / 2**30:.2f} GiB"
                    f" a device) on the engine's device(s), which have {free / 2**30:.2f} GiB free; lower"
                    " rollout.async_depth or give the engine more devices or memory (rollout.devices).")


def check_start(session: Session, spec: str, depth: int, view: EngineView) -> None:
  """The sampler's start-up checks of the engine's devices and memory, for `opdjax train` to run
  before it writes anything."""
  check_memory(engine_side(session, spec), session.student_params, depth, view)
