"""The JAX engine in a process of its own, pinned to its own cores: `rollout.engine=jax` with
`rollout.placement=disaggregated`.

Why a process: two XLA:CPU host devices of one process are not two cores (bench/core_split.py: a
device's work runs on any thread of XLA's pools), and on a TPU pod one multi-controller program
cannot split its hosts; a second JAX program on its own cores (chips) can. The same engine protocol
as every engine (opdjax.rollout.base): `export` (trainer thread) waits for the params and writes them
into a shared-memory block (/dev/shm) of the engine's pool, one copy a leaf; `load` (the sampling side)
sends the block's name, the sidecar reads it straight into its device arrays and acknowledges, and
the block goes back to the pool (so does a version dropped unloaded, `release`); `generate` sends the
prompts and gets the rollout's arrays back over a local socket (multiprocessing.connection, a
per-engine key). The sidecar runs `JaxEngine` on the engine-view model, so it realises every view
part the in-process engine does (packed FP8 weights arrive fake-quantized: `packed_weights=False`).

With a `teacher` (rollout.teacher_scoring='engine', opdjax.rollout.jax.teacher) the sidecar also holds
the fixed teacher, its config and params sent once at start (params through a shared-memory block of
their own, freed once loaded), and answers each `generate` with the rollout and the teacher's final
hidden states on it: one round trip, the teacher's layers on the engine's cores.

`python -m opdjax.rollout.jax.sidecar` is the sidecar's side; the engine starts it (SIGKILL when the
trainer dies) and `close()` stops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing import connection, resource_tracker, shared_memory

import numpy as np

from opdjax.errors import UserError
from opdjax.rollout import children
from opdjax.rollout.base import Capabilities, Rollout, RolloutEngine, SamplingParams, ScoredRollout, WeightUpdate
from opdjax.rollout.cores import TRAINER

ADDRESS_ENV, KEY_ENV = "OPDJAX_JAX_SIDECAR_ADDRESS", "OPDJAX_JAX_SIDECAR_KEY"
ROLLOUT_FIELDS = ("prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask", "rollout_logprobs")


class SidecarError(RuntimeError):
  pass


class JaxSidecarEngine(RolloutEngine):
  """A JaxEngine for `model_cfg` in its own process on `cpus`; this process's threads on
  `trainer_cpus` while it runs (opdjax.rollout.cores). `teacher`: (Model, params) of the teacher it
  scores every rollout with (its `generate` returns a ScoredRollout), or None."""

  capabilities = Capabilities(
      view_parts=frozenset({"compute_dtype", "kv_quant", "act_quant", "weights", "noise_sigma", "lag"}),
      packed_weights=False, processed_logprobs=True)

  def __init__(self, model_cfg, params=None, *, max_len: int, pad_id: int, eos_ids: Sequence[int], cpus,
               trainer_cpus, version: int = 0, teacher=None, startup_timeout_s: float = 600.0):
    import jax

    if jax.default_backend() != "cpu":  # its own accelerators would need their own visible devices
      raise UserError(f"rollout.placement='disaggregated' with rollout.engine='jax' runs the engine in a CPU process"
                      f" of its own; on {jax.default_backend()} give the engine devices of its own with"
                      " rollout.devices and rollout.async_depth (placement colocated), or use rollout.engine='vllm'.")
    self.cpus, self.trainer_cpus = sorted(cpus), sorted(trainer_cpus)
    self._version, self._proc, self._conn = version, None, None
    self._blocks = _Blocks()
    self.scores_teacher = teacher is not None
    self._lock = threading.Lock()  # one request at a time on the socket
    self._dir = tempfile.mkdtemp(prefix="opdjax-jax-sidecar-")
    self.log_path = os.path.join(self._dir, "sidecar.log")
    key = os.urandom(16)
    listener = connection.Listener(os.path.join(self._dir, "socket"), family="AF_UNIX", authkey=key)
    env = {**os.environ, ADDRESS_ENV: listener.address, KEY_ENV: key.hex(), "JAX_NUM_CPU_DEVICES": "1",
           "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), env.get("PYTHONPATH", "")]))
    TRAINER.acquire(self.trainer_cpus)
    try:
      with open(self.log_path, "ab") as log:  # forked under the sidecar's cores, which it and its threads inherit
        self._proc = children.popen([sys.executable, "-c", _ARMED], env=env, cpus=self.cpus, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT)
      self._conn = self._accept(listener, startup_timeout_s)
      teacher_cfg = None if teacher is None else dataclasses.asdict(teacher[0].cfg)
      self._call(("init", dataclasses.asdict(model_cfg), max_len, pad_id, tuple(eos_ids), teacher_cfg))
      if teacher is not None:  # fixed: sent once, through a block of its own freed once it is loaded
        block = _to_shm(teacher[1], None)
        try:
          self._call(("teacher", block.shm.name, block.layout, block.structure))
        finally:
          _free(block.shm)
      if params is not None:
        self.sync(params, version)
    except BaseException:
      self.close()
      raise
    finally:
      listener.close()

  def _accept(self, listener, timeout_s: float):
    got: list = []
    t = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive() and time.monotonic() < deadline:
      if self._proc.poll() is not None:
        raise SidecarError(f"the JAX engine's process exited with code {self._proc.returncode} while starting;"
                           f" its log {self.log_path} ends with:\n{self._log_tail()}")
      t.join(0.2)
    if not got:
      raise SidecarError(f"the JAX engine's process did not connect within {timeout_s:.0f} s; see {self.log_path}.")
    return got[0]

  def _log_tail(self, lines: int = 20) -> str:
    with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
      return "\n".join(f.read().splitlines()[-lines:])
    return "(no log)"

  def _call(self, msg):
    with self._lock:
      try:
        self._conn.send(msg)
        reply = self._conn.recv()
      except (EOFError, OSError) as e:
        raise SidecarError(f"the JAX engine's process died ({e}); its log {self.log_path} ends with:\n"
                           f"{self._log_tail()}") from None
    if reply[0] == "error":
      kind, text = reply[1], reply[2]
      raise (UserError if kind == "UserError" else SidecarError)(text)
    return reply

  @property
  def pid(self) -> int | None:
    return None if self._proc is None else self._proc.pid

  @property
  def host_cpus(self) -> list[int]:
    return self.cpus

  @property
  def params_version(self) -> int:
    return self._version

  def export(self, params, version: int) -> WeightUpdate:
    """`params` written into a shared-memory block of the engine's pool (one copy, on the trainer's
    thread; the next train step donates the device buffers). The wait for the step that computes
    them is that step's device time, reported apart (`time_export_wait_s`), not the export's."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(params)
    t1 = time.perf_counter()
    block = _to_shm(params, self._blocks)
    return WeightUpdate(version, params=block, stats={"time_export_s": time.perf_counter() - t1,
                                                       "time_export_wait_s": t1 - t0})

  def load(self, update: WeightUpdate) -> None:
    t0 = time.perf_counter()
    block = update.params
    if not block.live:
      raise SidecarError(f"params version {update.version} was loaded after its export was released or loaded.")
    try:
      self._call(("load", update.version, block.shm.name, block.layout, block.structure))
    finally:  # the sidecar holds the version in its device arrays once it acknowledges: the block is free
      self._blocks.give(block)
    self._version = update.version
    update.stats = {**update.stats, "time_reload_s": time.perf_counter() - t0}

  def release(self, update: WeightUpdate) -> None:
    self._blocks.give(update.params)

  def sync(self, params, version: int) -> None:
    self.load(self.export(params, version))

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int = 0) -> Rollout:
    import jax.numpy as jnp

    _, arrays, version = self._call(("generate", [list(map(int, p)) for p in prompts],
                                     dataclasses.asdict(sampling), int(seed)))
    fields = [jnp.asarray(arrays[k]) for k in ROLLOUT_FIELDS]
    if "teacher_hidden" in arrays:
      return ScoredRollout(*fields, params_version=version, sampling=sampling, seed=seed,
                           teacher_hidden=jnp.asarray(arrays["teacher_hidden"]))
    return Rollout(*fields, params_version=version, sampling=sampling, seed=seed)

  def close(self) -> None:
    if self._conn is not None:
      with contextlib.suppress(Exception):
        self._call(("close",))
      self._conn.close()
      self._conn = None
    if self._proc is not None:
      try:
        self._proc.wait(10)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait(5)
      self._proc = None
      TRAINER.release()
    self._blocks.close()
    shutil.rmtree(self._dir, ignore_errors=True)


@dataclasses.dataclass
class _Block:
  """A params version in shared memory: the block, each leaf's (offset, shape, dtype) and the tree of
  leaf indices (nested dicts)."""

  shm: shared_memory.SharedMemory
  layout: list
  structure: object
  live: bool = True  # False once given back to the pool (which may hand it to the next export)


class _Blocks:
  """The engine's shared-memory blocks, reused: exported versions take one (an asynchronous run holds
  up to depth + 1 at once), a load or a release gives it back. Thread-safe (export on the trainer's
  thread, load on the producer's)."""

  def __init__(self):
    self._free: list[shared_memory.SharedMemory] = []
    self._all: list[shared_memory.SharedMemory] = []
    self._lock = threading.Lock()

  def take(self, size: int) -> shared_memory.SharedMemory:
    with self._lock:
      for i, shm in enumerate(self._free):
        if shm.size >= size:
          return self._free.pop(i)
      shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
      self._all.append(shm)
      return shm

  def give(self, block: _Block | None) -> None:
    with self._lock:
      if block is not None and block.live:  # a second give (a load, then a release) is a no-op
        block.live = False
        if any(shm is block.shm for shm in self._all):
          self._free.append(block.shm)

  def close(self) -> None:
    with self._lock:
      for shm in self._all:
        _free(shm)
      self._all, self._free = [], []


def _to_shm(params, blocks: _Blocks | None) -> _Block:
  """`params`' leaves written into one block (64-byte aligned), from `blocks` or a new one of its own
  (None). On CPU a leaf's host view is its device buffer: one copy a leaf, straight into the block."""
  import jax

  leaves, treedef = jax.tree.flatten(params)
  leaves = [np.asarray(x) for x in leaves]
  layout, offset = [], 0
  for x in leaves:
    layout.append((offset, x.shape, x.dtype.str))
    offset += -(-x.nbytes // 64) * 64
  shm = blocks.take(offset) if blocks is not None else shared_memory.SharedMemory(create=True, size=max(offset, 1))
  for (off, _, _), x in zip(layout, leaves):
    np.ndarray(x.shape, x.dtype, buffer=shm.buf, offset=off)[...] = x
  return _Block(shm, layout, jax.tree.unflatten(treedef, list(range(len(leaves)))))


def _free(shm: shared_memory.SharedMemory | None) -> None:
  if shm is not None:
    shm.close()
    with contextlib.suppress(FileNotFoundError):
      shm.unlink()


# --- the sidecar's side ---------------------------------------------------------------------------

def _read_shm(blocks: dict, name: str, layout, structure):
  """Device arrays of the params a `_to_shm` block holds (the block stays mapped: the trainer owns it)."""
  import jax
  import jax.numpy as jnp

  if name not in blocks:
    blocks[name] = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(blocks[name]._name, "shared_memory")  # the trainer owns it
  buf = blocks[name].buf
  leaves = [jnp.array(np.ndarray(shape, np.dtype(dt), buffer=buf, offset=off)) for off, shape, dt in layout]
  return jax.tree.map(lambda i, leaves=leaves: leaves[i], structure)


def _serve(conn) -> None:
  import jax

  from opdjax.models.config import ModelConfig
  from opdjax.models.decoder import Model
  from opdjax.rollout.jax.engine import JaxEngine
  from opdjax.rollout.jax.teacher import TeacherScorer

  _, cfg, max_len, pad_id, eos_ids, teacher_cfg = conn.recv()
  engine = JaxEngine(Model(ModelConfig(**cfg)), None, max_len=max_len, pad_id=pad_id, eos_ids=eos_ids)
  conn.send(("ready", jax.devices()[0].platform))
  blocks: dict[str, shared_memory.SharedMemory] = {}
  scorer = None
  while True:
    msg = conn.recv()
    try:
      if msg[0] == "close":
        conn.send(("closed",))
        break
      if msg[0] == "load":
        _, version, name, layout, structure = msg
        engine.sync(_read_shm(blocks, name, layout, structure), version)
        jax.block_until_ready(engine._params)  # the block is free once this is acknowledged
        conn.send(("loaded", version))
      elif msg[0] == "teacher":  # its own block, which the trainer frees once this is acknowledged
        _, name, layout, structure = msg
        params = jax.block_until_ready(_read_shm(blocks, name, layout, structure))
        scorer = TeacherScorer(Model(ModelConfig(**teacher_cfg)), params)
        blocks.pop(name).close()
        conn.send(("teacher_loaded",))
      elif msg[0] == "generate":
        _, prompts, sampling, seed = msg
        r = engine.generate(prompts, SamplingParams(**sampling), seed=seed)
        arrays = {k: np.asarray(getattr(r, k)) for k in ROLLOUT_FIELDS}
        if scorer is not None:
          arrays["teacher_hidden"] = np.asarray(scorer(r))
        conn.send(("rollout", arrays, r.params_version))
    except Exception as e:  # noqa: BLE001 -- reported to the trainer, which raises it
      conn.send(("error", "UserError" if isinstance(e, UserError) else type(e).__name__, str(e)))
  for b in blocks.values():
    b.close()


# How the engine starts the sidecar: SIGKILL when the trainer dies (even by SIGKILL), armed before
# anything is imported (JAX's import takes a second): no orphan on its cores, and no graceful path that
# could hang on a socket nobody reads; the sidecar holds nothing a clean exit would save. Linux only.
_ARMED = children.armed("SIGKILL", "os._exit(1)",
                        f"import runpy\nrunpy.run_module({__name__!r}, run_name='__main__', alter_sys=True)\n")


def main() -> int:
  conn = connection.Client(os.environ[ADDRESS_ENV], family="AF_UNIX", authkey=bytes.fromhex(os.environ[KEY_ENV]))
  try:
    _serve(conn)
  except EOFError:  # the trainer went away
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
