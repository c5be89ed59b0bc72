"""Where a run's arrays live: on one device (no mesh: today's unsharded path, unchanged), or sharded
over a mesh by opdjax.parallel.rules. The Session holds one Placement; the train step (opdjax.training.step:
`create_state`, `train_step_shardings`), the teacher, the JAX engines and the held-out evaluation
all place their arrays through it.

Multi-process: every array is a global `jax.Array`; a process builds only the rows of a batch its
devices hold (`rows`, `batch`), and reads a whole array to the host only through `host`, a
collective every process calls at the same point of the same loop.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from opdjax.parallel import rules
from opdjax.parallel.devices import engine_mesh
from opdjax.parallel.mesh import check_fits, is_single_device, make_mesh


class Placement:
  def __init__(self, mesh: Mesh | None = None):
    self.mesh = mesh

  @classmethod
  def from_config(cls, mesh_cfg, model_cfgs: dict, rows: dict[str, int], devices=None,
                  note=lambda mesh: "") -> Placement:
    """The config's mesh over every device (or over `devices`: those an asynchronous JAX engine
    leaves, opdjax.parallel.devices), checked against the models (`{role: ModelConfig}`) and the
    batches (`{config key: rows}`); no mesh for the default all-1 mesh in a single process.
    `note(mesh)`: more for the start-up line (where the engine samples)."""
    if is_single_device(mesh_cfg) and jax.process_count() == 1:
      said = note(None)
      if said:
        print(f"opdjax: the trainer on device 0, unsharded; {said}", file=sys.stderr, flush=True)
      return cls(None)
    mesh = make_mesh(mesh_cfg, devices)
    check_fits(mesh, model_cfgs, rows)
    said = note(mesh)
    if jax.process_index() == 0:
      print(f"opdjax: trainer {describe(mesh)}{'; ' + said if said else ''}", file=sys.stderr, flush=True)
    return cls(mesh)

  @classmethod
  def engine(cls, devices, trainer: Placement, model_cfg, batch: int) -> Placement:
    """The asynchronous JAX engine's own placement over `devices` (opdjax.parallel.devices.engine_mesh)."""
    return cls(engine_mesh(list(devices), trainer.mesh, model_cfg, batch))

  def __eq__(self, other) -> bool:  # engine caches are keyed by placement (opdjax.pipeline.session.EnginePool)
    return isinstance(other, Placement) and self.mesh == other.mesh

  def __hash__(self) -> int:
    return hash(self.mesh)

  @property
  def devices(self) -> list:
    """The mesh's devices, in mesh order ([] without a mesh: the default device)."""
    return [] if self.mesh is None else list(self.mesh.devices.flat)

  @property
  def sharded(self) -> bool:
    return self.mesh is not None

  @property
  def primary(self) -> bool:
    """The process that writes files (metrics, config, plots, exports)."""
    return jax.process_index() == 0

  # --- params and train state ---

  def params(self, params):
    """`params` (host or device arrays) placed by the partition rules; each device receives only
    its shards (from the host copy every process holds after loading)."""
    if self.mesh is None:
      return params
    shardings = rules.param_shardings(params, self.mesh)
    return jax.tree.map(self._put, params, shardings)

  def _put(self, x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and jax.process_count() == 1:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

  def state_shardings(self, state):
    return rules.mirrored_shardings(state, state.params, self.mesh)

  # --- batches ---

  def rows(self, n: int) -> slice:
    """This process's rows of an `n`-row batch (all of them in a single process)."""
    if self.mesh is None or jax.process_count() == 1:
      return slice(0, n)
    spans = {(s[0].start or 0, n if s[0].stop is None else s[0].stop)
             for s in rules.rows_sharding(self.mesh, 1).addressable_devices_indices_map((n,)).values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    assert sum(b - a for a, b in spans) == hi - lo, f"this process's rows are not contiguous: {sorted(spans)}"
    return slice(lo, hi)

  def local_rows(self, x) -> np.ndarray:
    """This process's rows (`rows`) of a batch array, on the host, without a collective; the whole array
    in a single process."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    mine = self.rows(x.shape[0])
    out = np.empty((mine.stop - mine.start, *x.shape[1:]), x.dtype)
    for shard in x.addressable_shards:
      first = shard.index[0]
      at = slice((first.start or 0) - mine.start, (x.shape[0] if first.stop is None else first.stop) - mine.start)
      out[(at, *shard.index[1:])] = np.asarray(shard.data)
    return out

  def batch(self, local, n: int):
    """A global `[n, ...]` array, rows over the batch axes, from this process's rows `local`."""
    if self.mesh is None:
      return jnp.asarray(local)
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(rules.rows_sharding(self.mesh, local.ndim), local,
                                                  (n, *local.shape[1:]))

  def put_batch(self, tree):
    """Device arrays of a batch resharded to rows over the batch axes (a no-op when they are)."""
    if self.mesh is None:
      return tree
    return jax.tree.map(lambda x: jax.device_put(x, rules.rows_sharding(self.mesh, x.ndim)), tree)

  def kv_cache(self, model, batch: int, length: int, dtype=None):
    """The engine's KV cache (opdjax.models.kv_cache), created sharded (rows over the batch axes,
    key/value heads over tensor: `rules.kv_cache_shardings`)."""
    if self.mesh is None:
      return model.init_cache(batch, length, dtype)
    init = lambda: model.init_cache(batch, length, dtype)
    return jax.jit(init, out_shardings=rules.kv_cache_shardings(jax.eval_shape(init), self.mesh))()

  def generate_jit_kw(self, cache) -> dict:
    """jax.jit keywords of the engine's generate over `cache` (its structure): its outputs (tokens,
    mask, logprobs, cache) stay sharded as its inputs are, so the donated cache comes back in place."""
    if self.mesh is None:
      return {}
    rows = rules.rows_sharding(self.mesh, 2)
    return {"out_shardings": (rows, rows, rows, rules.kv_cache_shardings(cache, self.mesh))}

  # --- host ---

  def host(self, x) -> np.ndarray:
    """The whole value of `x` on this host; with several processes a collective (all call it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

  def host_tree(self, tree):
    return jax.tree.map(self.host, tree)


SINGLE = Placement(None)


def describe(mesh: Mesh) -> str:
  """'mesh data=1 fsdp=4 tensor=1 over 4 devices (1 process x 4 cpu)'."""
  axes = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
  return (f"mesh {axes} over {mesh.size} devices ({jax.process_count()} process(es) x {jax.local_device_count()}"
          f" {jax.devices()[0].platform})")
