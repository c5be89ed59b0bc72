"""Multi-process runs on JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same `opdjax train` on its own devices; process 0 also hosts the
coordinator. `initialize` connects them (explicit coordinator, or JAX's own detection under SLURM /
Open MPI when their variables say there are several tasks), with CPU collectives over gloo.

JAX aborts a process with a C++ stack trace when the coordinator cannot be reached or a peer
dies; here both become one clear line and a prompt exit:
- start-up: a timer ends the process with an error naming the coordinator after `timeout_s`;
- during the run: a watchdog holds a TCP connection between process 0 and every other process
  (the address goes through the coordinator's key-value store). A killed process's connection
  closes at once, so the survivors exit with an error naming it (JAX's heartbeat,
  `HEARTBEAT_S`, is the backstop for a host that vanishes without closing anything).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
import zlib

import jax
import numpy as np

from opdjax.errors import UserError

HEARTBEAT_S = 30  # JAX declares a silent process dead after this long (and aborts the others)
_CONNECT_S = 120  # the watchdog connections, opened right after every process joined
_BYE = b"bye\n"
GRACE_S = 3.0  # an error's wait for the watchdog's line when a peer may have died (grace_for_lost_peer)


class _State:
  watchdog: _Watchdog | None = None


def detected_tasks() -> int:
  """How many tasks SLURM or Open MPI launched this process among (1 outside them)."""
  for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
    if os.environ.get(var, "").isdigit():
      return int(os.environ[var])
  return 1


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               timeout_s: float = 120.0) -> bool:
  """Joins the run's processes; returns whether this is a multi-process run. No flags and no
  scheduler with several tasks: a single process, nothing to do."""
  explicit = coordinator is not None or num_processes is not None or process_id is not None
  if explicit and (coordinator is None or num_processes is None or process_id is None):
    raise UserError("--coordinator HOST:PORT, --num-processes N and --process-id I go together; give all three"
                    " (or none, to let jax.distributed detect SLURM / Open MPI).")
  if not explicit and detected_tasks() <= 1:
    return False
  if explicit:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise UserError(f"--coordinator {coordinator!r}: give HOST:PORT, e.g. 10.0.0.1:8476.")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise UserError(f"--process-id {process_id} with --num-processes {num_processes}: give 0 <= I < N.")
    if num_processes == 1:
      return False
  # CPU collectives across processes (a no-op for GPU runs, whose collectives are NCCL's).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  where = coordinator or "the address SLURM / Open MPI give"
  timer = threading.Timer(timeout_s, _startup_timeout, args=(where, num_processes, process_id, timeout_s))
  timer.daemon = True
  timer.start()
  try:
    # JAX's own timeout comes after ours: ours names the coordinator, JAX's aborts with a stack trace.
    kw = {"initialization_timeout": int(timeout_s) + 60, "heartbeat_timeout_seconds": HEARTBEAT_S}
    if explicit:
      jax.distributed.initialize(coordinator, num_processes, process_id, **kw)
    else:
      jax.distributed.initialize(**kw)
  finally:
    timer.cancel()
  if jax.process_count() > 1:
    _State.watchdog = _Watchdog(coordinator.rpartition(":")[0] if coordinator else None)
    cache_on_every_process()
  return jax.process_count() > 1


_CACHE_WRITE_ARGS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]


def cache_on_every_process() -> bool:
  """Lets this process write the persistent compilation cache entries it compiles (JAX_COMPILATION_CACHE_DIR);
  returns whether it does. JAX writes them from process 0 only. A program a process runs on its own devices (the
  JAX engine's rollouts, the scoring of its own rows) has a key naming those devices, so process 0 never writes
  it, and every other process compiled it again at each start, a resume included: process 1 of a 2-process demo
  run missed 89 programs at every start (measured 2026-12-07 on the 2-core box: a warm start of both processes
  took 39 CPU-s and 25 s, 15 CPU-s and 9 s with this). JAX skips a key already written; on a cold start the
  processes may write the same multi-process program's key at once, which a store shared by many hosts pays
  for. Process 0 keeps JAX's writer, and so does every process where JAX's private writer has changed shape."""
  import inspect
  import warnings

  from jax._src import compilation_cache, compiler

  original = getattr(compiler, "_cache_write", None)
  if jax.process_index() == 0 or original is None:
    return False
  if getattr(original, "opdjax_every_process", False):
    return True
  if list(inspect.signature(original).parameters) != _CACHE_WRITE_ARGS:
    return False

  def _cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if host_callbacks or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
      return  # JAX's own rules, less its process-0 test
    try:
      compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(compile_time_secs))
    except Exception as ex:  # noqa: BLE001 -- a cache that cannot be written costs a compile, as in JAX's writer
      if jax.config.jax_raise_persistent_cache_errors:
        raise
      warnings.warn(f"Error writing persistent compilation cache entry for {module_name!r}: "
                    f"{type(ex).__name__}: {ex}", stacklevel=2)

  _cache_write.opdjax_every_process = True
  compiler._cache_write = _cache_write  # noqa: SLF001
  return True


def _startup_timeout(where: str, n, pid, timeout_s: float) -> None:
  reachable = ""
  if ":" in where:
    host, _, port = where.rpartition(":")
    try:
      socket.create_connection((host, int(port)), timeout=2).close()
      reachable = " The coordinator answers, so some process(es) never joined: start every process with the same"
      reachable += f" --coordinator and --num-processes ({n}), each with its own --process-id."
    except OSError:
      reachable = (" Nothing answers there: start process 0 (it hosts the coordinator) and check the host, the port"
                   " and the firewall.")
  _die(f"could not join the {n or ''} processes through the coordinator at {where} within {timeout_s:.0f} s"
       f" (this is process {pid}).{reachable}")


def _die(message: str) -> None:
  server = sys.modules.get("opdjax.rollout.vllm.server")  # imported if this process started any vLLM server
  if server is not None:
    server.kill_started()  # os._exit runs no atexit stop: the servers go first, whole process groups
  print(f"opdjax: error: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(3)


def grace_for_lost_peer(grace_s: float = GRACE_S) -> None:
  """This process is about to stop with an error. In a multi-process run a collective with a dead peer fails
  (gloo: 'connection reset by peer') a moment before the watchdog reads that peer's EOF; the watchdog gets
  `grace_s` to end the process with its one line naming the lost process and host instead."""
  w = _State.watchdog
  deadline = time.monotonic() + grace_s
  while w is not None and not w.closing and w.peers and time.monotonic() < deadline:
    time.sleep(0.05)


def finish() -> None:
  """A clean end of this process: the watchdog tells its peers not to treat the exit as a death."""
  if _State.watchdog is not None:
    _State.watchdog.close()
    _State.watchdog = None


class _Watchdog:
  """TCP connections process 0 <-> every other process; an EOF without a goodbye is a death."""

  def __init__(self, host: str | None):
    from jax._src.distributed import global_state

    client, self.pid, self.n = global_state.client, jax.process_index(), jax.process_count()
    self.peers: dict[socket.socket, int] = {}
    self.hosts: dict[int, str] = {}  # process -> its host name, for the line that names a lost one
    self.closing = False
    key = "opdjax/watchdog"
    if self.pid == 0:
      server = socket.create_server(("", 0))
      host = host or (global_state.coordinator_address or "").rpartition(":")[0] or socket.gethostname()
      client.key_value_set(key, f"{host}:{server.getsockname()[1]}")
      server.settimeout(_CONNECT_S)
      try:
        for _ in range(self.n - 1):
          conn, _ = server.accept()
          pid, _, name = conn.recv(256).decode().strip().partition(" ")
          self.peers[conn] = int(pid)
          self.hosts[int(pid)] = name
      except OSError as e:
        raise UserError(f"only {len(self.peers)} of the {self.n - 1} other processes opened the watchdog connection"
                        f" to process 0 ({host}:{server.getsockname()[1]}) within {_CONNECT_S} s ({e}); check that"
                        " the processes can reach each other on any TCP port.") from None
      finally:
        server.close()
    else:
      addr = client.blocking_key_value_get(key, _CONNECT_S * 1000)
      h, _, p = addr.rpartition(":")
      try:
        conn = socket.create_connection((h, int(p)), timeout=_CONNECT_S)
      except OSError as e:
        raise UserError(f"process {self.pid} cannot open the watchdog connection to process 0 at {addr} ({e});"
                        " check that the processes can reach each other on any TCP port.") from None
      conn.sendall(f"{self.pid} {socket.gethostname()}\n".encode())
      self.peers[conn] = 0
      self.hosts[0] = h
    for conn in self.peers:
      conn.settimeout(None)
    threading.Thread(target=self._watch, name="opdjax-watchdog", daemon=True).start()

  def _watch(self) -> None:
    while self.peers:
      ready, _, _ = select.select(list(self.peers), [], [], 1.0)
      for conn in ready:
        try:
          data = conn.recv(64)
        except OSError:
          data = b""
        peer = self.peers.pop(conn)
        conn.close()
        if self.closing or data.startswith(_BYE):
          continue
        where = f"host {self.hosts[peer]}" if self.hosts.get(peer) else "its host"
        if peer == 0 and self.pid != 0:
          what = f"process 0 on {where} (it hosts the coordinator and stops when any process stops) is gone"
        else:
          what = f"process {peer} of {self.n} on {where} stopped"
        _die(f"{what}; this process (process {self.pid}) stops too instead of waiting for it. Run the same"
             " command on every process to resume from the last complete checkpoint.")

  def close(self) -> None:
    self.closing = True
    for conn in list(self.peers):
      try:
        conn.sendall(_BYE)
      except OSError:
        pass


def barrier(name: str) -> None:
  """Every process reaches `name` before any goes on (no-op in a single process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def check_same_config(cfg_dict: dict) -> None:
  """One error, on every process, naming the first config key whose value differs across processes."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  from opdjax.config.schema import flat

  items = sorted(flat(cfg_dict).items())
  hashes = np.asarray([zlib.crc32(json.dumps([k, v], sort_keys=True, default=str).encode()) for k, v in items],
                      np.uint32).view(np.int32)
  counts = np.asarray(multihost_utils.process_allgather(np.int32(len(hashes))))
  if len(set(counts.tolist())) > 1:
    raise UserError(f"the processes' configs have different keys ({counts.tolist()} keys): run the same opdjax"
                    " version on every process.")
  every = np.asarray(multihost_utils.process_allgather(hashes))  # [processes, keys]
  differs = np.flatnonzero((every != every[0]).any(axis=0))
  if differs.size:
    k, v = items[differs[0]]
    others = [p for p in range(every.shape[0]) if every[p, differs[0]] != every[0, differs[0]]]
    raise UserError(f"config key {k} differs across processes (process {jax.process_index()} has {v!r}; processes"
                    f" {others} differ from process 0): give every process the same config and overrides.")
