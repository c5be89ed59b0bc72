"""Child processes that die with the trainer, whichever of its threads starts them.

Every engine opdjax starts beside the trainer (vLLM servers, the JAX engine's sidecar) must not outlive
it, even when it is SIGKILLed (a node's OOM killer, a scheduler's preemption): Linux's parent-death
signal (PR_SET_PDEATHSIG), armed first thing in the child, does that. But Linux sends it when the
*thread* that forked the child exits, not the process: a server first started from the asynchronous
producer's thread died when the guard's backoff ended that thread. So every child here is forked by
one daemon thread that lives as long as the process (`popen`, whatever thread calls it), and its
bootstrap (`armed`) is written once: arm the signal, then leave at once if the trainer already died
between the fork and the arming.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import subprocess
import threading

PARENT_ENV = "OPDJAX_PARENT_PID"
_requests: queue.SimpleQueue = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def armed(death_signal: str, orphaned: str, body: str, setup: str = "") -> str:
  """Python source for `python -c`: `setup` (e.g. the signal's handler), PR_SET_PDEATHSIG with
  `signal.<death_signal>`, `orphaned` (a statement) when the trainer (PARENT_ENV) is already gone, then `body`."""
  return ("import ctypes, os, signal\n" + setup +
          f"ctypes.CDLL(None).prctl(1, signal.{death_signal})  # PR_SET_PDEATHSIG\n"
          f"if os.getppid() != int(os.environ[{PARENT_ENV!r}]): {orphaned}  # the trainer died before\n"
          + body)


def _fork(cmd, cpus, kw) -> subprocess.Popen:
  if cpus is None:
    return subprocess.Popen(cmd, **kw)
  # Forked under `cpus` (this thread takes the mask just for the fork; no preexec_fn: JAX's threads make a
  # Python-level fork unsafe), which the child and its threads inherit.
  mask = sorted(os.sched_getaffinity(0))
  os.sched_setaffinity(0, cpus)
  try:
    return subprocess.Popen(cmd, **kw)
  finally:
    os.sched_setaffinity(0, mask)


def _serve() -> None:
  while True:
    future, args = _requests.get()
    if future.set_running_or_notify_cancel():
      try:
        future.set_result(_fork(*args))
      except BaseException as e:  # noqa: BLE001 -- the caller's thread raises it
        future.set_exception(e)


def popen(cmd, *, env: dict, cpus=None, **kw) -> subprocess.Popen:
  """`subprocess.Popen(cmd, env=env + PARENT_ENV, **kw)` forked by the process's spawner thread (see the
  module doc), optionally under the CPU affinity `cpus`. The spawner is a daemon thread that never
  returns: it ends with the process (interpreter shutdown does not join it, so the children's graceful
  stops at exit still run first)."""
  global _spawner
  with _spawner_lock:
    if _spawner is None or not _spawner.is_alive():
      _spawner = threading.Thread(target=_serve, name="opdjax-spawner", daemon=True)
      _spawner.start()
  future: cf.Future = cf.Future()
  _requests.put((future, (cmd, cpus, {**kw, "env": {**env, PARENT_ENV: str(os.getpid())}})))
  return future.result()
