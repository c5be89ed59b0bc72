"""CPU sets and pinning: the cores a process may use, CPU lists as `taskset -c` writes them, and the
trainer's threads pinned to its share while an engine on cores of its own runs.

Which cores each side gets (`rollout.placement=disaggregated`) is decided once, by
opdjax.rollout.deploy (`core_split`); the JAX engine's process (opdjax.rollout.jax.sidecar) and the
pinned vLLM servers (opdjax.rollout.vllm.pinned) are started under their share and call `TRAINER`
for the rest. Threads, not the process: Linux affinity is per thread, and XLA's thread pools exist
before an engine starts.

Why processes and not host devices: bench/core_split.py measures that two XLA:CPU host devices of one
process are not two cores (XLA runs a device's work on any thread of its pools), while two processes
pinned apart are.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from opdjax.errors import UserError

PLACEMENTS = ("colocated", "disaggregated")


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


@dataclasses.dataclass(frozen=True)
class CoreSplit:
  """The cores of a disaggregated engine (every server's together, or the JAX engine's process) and of
  the trainer."""

  server: list[int]
  trainer: list[int]


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


