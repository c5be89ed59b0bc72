"""Which cores each side runs on when the rollout engine is disaggregated (`rollout.placement`).

`colocated` (the default): engine and trainer time-share every core (and device). `disaggregated`:
the engine owns its own. The JAX engine then runs in a process of its own on the upper half of the
cores this process may use (opdjax.rollout.jax_sidecar). For a vLLM server opdjax starts on CPU that means its cores,
`rollout.vllm.cpus` (a CPU list, '1' or '2-3,6'; default: the upper half of the cores this process
may use): the server's process is started under that affinity mask (its threads and children inherit
it) and vLLM's OpenMP threads are bound to the same cores (`VLLM_CPU_OMP_THREADS_BIND`, one list a
tensor-parallel rank, '|' between ranks: vllm/envs.py); the trainer pins every thread of its own
process to the remaining cores while the server runs. Threads, not the process: Linux affinity is
per thread, and XLA's thread pools exist before the server starts.

Why processes and not host devices: bench/core_split.py measures that two XLA:CPU host devices of one
process are not two cores (XLA runs a device's work on any thread of its pools), while two processes
pinned apart are.

Errors at start-up (`check`, before anything is written): cores this process may not use (beyond
the machine's, or outside its affinity mask), a list leaving the trainer no core, fewer than two
cores for two sides, a list that does not split evenly into the servers' tensor-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from opdjax.errors import UserError
from opdjax.rollout.vllm.server import VllmServer

PLACEMENTS = ("colocated", "disaggregated")
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vllm/envs.py: CPU ids of the OpenMP threads, ranks split by '|'


def parse_cpus(text: str, key: str = "rollout.vllm.cpus") -> list[int]:
  """'0-2,5' -> [0, 1, 2, 5] (sorted, distinct)."""
  out: set[int] = set()
  for part in filter(None, (p.strip() for p in text.split(","))):
    lo, dash, hi = part.partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
      raise UserError(f"{key}={text!r}: give a CPU list as `taskset -c` takes it, e.g. '1', '2-3' or '0,2-3'.")
    out.update(range(int(lo), int(hi if dash else lo) + 1))
  if not out:
    raise UserError(f"{key}={text!r} names no CPU; give a CPU list, e.g. '1' or '2-3'.")
  return sorted(out)


def format_cpus(cpus) -> str:
  """[0, 1, 2, 5] -> '0-2,5'."""
  cpus, runs = sorted(cpus), []
  for c in cpus:
    if runs and c == runs[-1][1] + 1:
      runs[-1][1] = c
    else:
      runs.append([c, c])
  return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus() -> list[int]:
  """The cores this process may run on (its affinity mask: taskset, SLURM, cgroups), as it was before
  a disaggregated engine pinned the trainer."""
  with TRAINER.lock:
    return list(TRAINER.before) if TRAINER.holders else sorted(os.sched_getaffinity(0))


def _started_here(vcfg) -> bool:
  return not (vcfg.url or [u for u in vcfg.urls.split(",") if u.strip()])


@dataclasses.dataclass(frozen=True)
class CoreSplit:
  server: list[int]  # every server's cores together
  trainer: list[int]


def core_split(rcfg, allowed: list[int] | None = None) -> CoreSplit | None:
  """The cores of a disaggregated vLLM server started here and of the trainer; None when nothing is
  pinned (colocated; the JAX engine; attached servers, pinned where they run; GPU servers without
  `rollout.vllm.cpus`, disaggregated by their GPUs). Raises the start-up errors of the module doc."""
  allowed = allowed_cpus() if allowed is None else sorted(allowed)
  if rcfg.placement != "disaggregated":
    return None
  if len(allowed) < 2:
    raise UserError(f"rollout.placement='disaggregated' runs the rollout engine and the trainer on cores of their own:"
                    f" it needs at least 2 cores, this process may use {len(allowed)} ({format_cpus(allowed)}); give"
                    " the job more cores (taskset, SLURM --cpus-per-task) or use rollout.placement=colocated.")
  v = rcfg.vllm
  if rcfg.engine == "jax":  # its own process (opdjax.rollout.jax_sidecar) on the upper half
    half = len(allowed) // 2
    return CoreSplit(allowed[len(allowed) - half:], allowed[:len(allowed) - half])
  if not _started_here(v) or (v.gpus and not v.cpus):
    return None
  ranks = v.num_servers * v.tensor_parallel_size
  if v.cpus:
    server = parse_cpus(v.cpus)
    beyond = [c for c in server if c not in allowed]
    if beyond:
      raise UserError(f"rollout.vllm.cpus={v.cpus!r} names core(s) {format_cpus(beyond)} this process may not use: the"
                      f" machine has {os.cpu_count()} and this process may use {format_cpus(allowed)}; give the"
                      " server cores out of those.")
  else:  # the upper half, whole ranks
    n = max(ranks, len(allowed) // 2 // ranks * ranks)
    server = allowed[len(allowed) - n:]
  trainer = [c for c in allowed if c not in server]
  if not trainer:
    raise UserError(f"rollout.vllm.cpus={format_cpus(server)!r} overlaps the trainer's cores: it takes every core this"
                    f" process may use ({format_cpus(allowed)}), so the trainer would share the server's; leave at"
                    f" least one to the trainer (e.g. rollout.vllm.cpus={format_cpus(allowed[1:])!r}).")
  if len(server) % ranks:
    raise UserError(f"rollout.vllm.cpus={format_cpus(server)!r} lists {len(server)} core(s), which do not split"
                    f" evenly into {v.num_servers} server(s) x tensor_parallel_size={v.tensor_parallel_size}; give a"
                    f" multiple of {ranks} cores.")
  return CoreSplit(server, trainer)


def check_config(rcfg) -> None:
  """The config's own checks of `rollout.placement` and `rollout.vllm.cpus` (RolloutConfig.check)."""
  if rcfg.placement not in PLACEMENTS:
    raise UserError(f"rollout.placement={rcfg.placement!r}; choose one of {', '.join(repr(p) for p in PLACEMENTS)}.")
  v = rcfg.vllm
  if not v.cpus:
    return
  parse_cpus(v.cpus)
  if rcfg.engine != "vllm":
    raise UserError(f"rollout.vllm.cpus={v.cpus!r} pins the vLLM server; with rollout.engine={rcfg.engine!r} leave it"
                    " empty (a disaggregated JAX engine's process takes the upper half of the cores).")
  if rcfg.placement != "disaggregated":
    raise UserError(f"rollout.vllm.cpus={v.cpus!r} gives the vLLM server cores of its own: set"
                    " rollout.placement=disaggregated, or leave rollout.vllm.cpus empty.")
  if not _started_here(v):
    raise UserError(f"rollout.vllm.cpus={v.cpus!r} pins a server opdjax starts; an attached server (rollout.vllm.url"
                    f"/urls) is pinned where it is started ({BIND_ENV}, taskset): leave rollout.vllm.cpus empty.")


def check(rcfg) -> None:
  """The start-up checks (opdjax.rollout.factory.check_engine)."""
  core_split(rcfg)


def server_config(rcfg):
  """The rollout config with `rollout.vllm.cpus` resolved (the default split filled in), for the
  factory's servers."""
  split = core_split(rcfg)
  if split is None:
    return rcfg
  return dataclasses.replace(rcfg, vllm=dataclasses.replace(rcfg.vllm, cpus=format_cpus(split.server)))


def server_cpus(vcfg, index: int | None) -> list[int]:
  """Server `index`'s own cores out of `vcfg.cpus` (an equal share each); [] when not pinned."""
  if not getattr(vcfg, "cpus", ""):
    return []
  cpus = parse_cpus(vcfg.cpus)
  share = len(cpus) // max(vcfg.num_servers, 1)
  i = index or 0
  return cpus[i * share:(i + 1) * share]


def server_class(vcfg, index: int | None, env: dict) -> tuple[type, dict]:
  """The server class and its pinning arguments for server `index` (adding vLLM's thread binding to
  `env`): `PinnedVllmServer` on its share of `rollout.vllm.cpus`, else a plain `VllmServer`."""
  own = server_cpus(vcfg, index)
  if not own:
    return VllmServer, {}
  env[BIND_ENV] = omp_bind(own, vcfg.tensor_parallel_size)
  every = parse_cpus(vcfg.cpus)
  return PinnedVllmServer, {"cpus": own, "trainer_cpus": [c for c in allowed_cpus() if c not in every]}


def omp_bind(cpus: list[int], tensor_parallel_size: int) -> str:
  """VLLM_CPU_OMP_THREADS_BIND for one server: its cores split into its ranks, e.g. '2|3'."""
  n = len(cpus) // tensor_parallel_size
  return "|".join(format_cpus(cpus[r * n:(r + 1) * n]) for r in range(tensor_parallel_size))


def pin_threads(cpus) -> None:
  """Every thread of this process onto `cpus` (new threads inherit their creator's mask)."""
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), cpus)
    except (ProcessLookupError, FileNotFoundError):
      pass  # a thread that ended meanwhile


class _TrainerPin:
  """The trainer's pinning, held while any pinned server runs; the mask before it comes back after
  the last one stops (tests and sessions go on in the same process)."""

  def __init__(self):
    self.lock, self.holders, self.before = threading.Lock(), 0, None

  def acquire(self, trainer: list[int]) -> None:
    with self.lock:
      if self.holders == 0:
        self.before = sorted(os.sched_getaffinity(0))
      self.holders += 1
      pin_threads(trainer)

  def release(self) -> None:
    with self.lock:
      if self.holders == 0:
        return
      self.holders -= 1
      if self.holders == 0:
        pin_threads(self.before)


TRAINER = _TrainerPin()


class PinnedVllmServer(VllmServer):
  """A VllmServer started under the affinity mask `cpus` (the calling thread takes it just for the
  fork: the child and everything it starts inherit it), with the trainer's threads on `trainer_cpus`
  while it runs."""

  def __init__(self, *args, cpus: list[int], trainer_cpus: list[int], **kw):
    super().__init__(*args, **kw)
    self.cpus, self.trainer_cpus = list(cpus), list(trainer_cpus)
    self._pinned = False
    self._mask: list[int] | None = None

  def launch(self) -> PinnedVllmServer:
    if self.running:
      return self
    if not self._pinned:
      TRAINER.acquire(self.trainer_cpus)
      self._pinned = True
    self._mask = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, self.cpus)
    try:
      return super().launch()
    finally:
      self._restore()  # the child exists: this thread goes back to the trainer's cores

  def _restore(self) -> None:
    if self._mask is not None:
      os.sched_setaffinity(0, self._mask)
      self._mask = None

  def stop(self, timeout_s: float = 30.0) -> None:
    super().stop(timeout_s)
    if self._pinned:
      self._pinned = False
      TRAINER.release()
