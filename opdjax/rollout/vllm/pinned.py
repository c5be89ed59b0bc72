"""vLLM servers on cores of their own (rollout.placement=disaggregated on CPU): each server's share of
`rollout.vllm.cpus`, vLLM's OpenMP thread binding for its tensor-parallel ranks, and the server
process started under that affinity mask while the trainer's threads keep the rest (opdjax.rollout.cores)."""

from __future__ import annotations

from opdjax.rollout.cores import TRAINER, allowed_cpus, format_cpus, parse_cpus
from opdjax.rollout.vllm.server import VllmServer

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vllm/envs.py: CPU ids of the OpenMP threads, ranks split by '|'


def server_cpus(vcfg, index: int | None) -> list[int]:
  """Server `index`'s own cores out of `vcfg.cpus` (an equal share each); [] when not pinned."""
  if not vcfg.cpus:
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


class PinnedVllmServer(VllmServer):
  """A VllmServer forked under the affinity mask `cpus` (the spawner thread, opdjax.rollout.children, takes
  it just for the fork: the child and everything it starts inherit it), with the trainer's threads on
  `trainer_cpus` while it runs."""

  def __init__(self, *args, cpus: list[int], trainer_cpus: list[int], **kw):
    super().__init__(*args, **kw)
    self.cpus, self.trainer_cpus = list(cpus), list(trainer_cpus)
    self.fork_cpus = self.cpus
    self._pinned = False

  def launch(self) -> PinnedVllmServer:
    if self.running:
      return self
    if not self._pinned:
      TRAINER.acquire(self.trainer_cpus)
      self._pinned = True
    return super().launch()

  def stop(self, timeout_s: float = 30.0) -> None:
    super().stop(timeout_s)
    if self._pinned:
      self._pinned = False
      TRAINER.release()
