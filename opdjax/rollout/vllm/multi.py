"""Several vLLM sidecars behind one engine (`rollout.vllm.urls` or `rollout.vllm.num_servers`).

A step's weights are exported once and every server reloads that folder before it samples again: a
server that cannot reload is left out until a later sync reaches it, so no server ever samples with
other weights than the rollout's `params_version`. The prompts are spread across the servers in
contiguous shares; every prompt keeps its own seed (`prompt_seeds(seed, index)`), so which server
samples it does not change its tokens. A share whose server fails (after that server's own restart
policy: a server started here is restarted from the latest weights, `VllmEngine`) is sampled again on
the servers still up, and each result lands at its prompt's index: nothing is lost or doubled.
`served` records, per generate call, which server sampled how many prompts at which version.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Sequence

from opdjax.models.config import ModelConfig
from opdjax.rollout.base import WeightUpdate
from opdjax.rollout.vllm.client import VllmError
from opdjax.rollout.vllm.engine import VllmEngine, VllmEngineBase

log = logging.getLogger(__name__)


def shares(n: int, k: int) -> list[range]:
  """`n` prompts in `k` contiguous shares, sizes differing by at most one."""
  q, r = divmod(n, k)
  out, start = [], 0
  for i in range(k):
    out.append(range(start, start + q + (i < r)))
    start += q + (i < r)
  return out


class MultiVllmEngine(VllmEngineBase):
  def __init__(self, engines: Sequence[VllmEngine], model_cfg: ModelConfig, *, pad_id: int,
               eos_ids: Sequence[int] | None = None, version: int = 0, export_dir: str | None = None,
               probe_tolerance: float = 0.0, probe_action: str = "error"):
    if not engines:
      raise VllmError("a multi-server vLLM engine needs at least one server.")
    self.engines = list(engines)
    self.versions: list[int | None] = [version] * len(self.engines)  # what each server holds (None: unknown)
    self.served: list[dict] = []  # the last generate call's {url, prompts, version} per server that sampled
    self._pool = cf.ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="opdjax-vllm-multi")
    self._target = version
    info = self.engines[0].client.info()
    first = self.engines[0].exporter  # the servers share a config: the first one's precision
    precision = (first.dtype, first.quantization) if first is not None else ("float32", "")
    super().__init__(model_cfg, pad_id=pad_id, eos_ids=eos_ids, version=version, export_dir=export_dir, info=info,
                     precision=precision, probe_tolerance=probe_tolerance, probe_action=probe_action,
                     untie=first is not None and first.untie)

  def tags(self, version: int) -> dict:
    return {"rollout_servers": [dict(d) for d in self.served]} if self.served else {}

  @property
  def urls(self) -> list[str]:
    return [e.url for e in self.engines]

  def hold(self, folder: str) -> None:
    super().hold(folder)
    for e in self.engines:  # each server's restarts start from it too, until a sync reaches it
      e._weights_path = self._weights_path  # noqa: SLF001

  def load(self, update: WeightUpdate) -> None:
    self._target = update.version  # what _reload installs; `params_version` changes once a server holds it
    super().load(update)

  def _reload(self, path: str) -> None:
    """Every server reloads `path`, concurrently; those that fail hold no known version until a
    later sync reaches them. An error only when no server took the weights."""
    version = self._target

    def one(i):
      e = self.engines[i]
      e._reload(path)
      e._weights_path = path  # its restarts start from these weights  # noqa: SLF001
      return i

    futures = {self._pool.submit(one, i): i for i in range(len(self.engines))}
    errors = []
    for f in cf.as_completed(futures):
      i = futures[f]
      if f.exception() is None:
        self.versions[i] = version
      else:
        self.versions[i] = None
        errors.append(f"{self.engines[i].url}: {f.exception()}")
        log.warning("vLLM server %s could not load version %d; its prompts go to the others: %s",
                    self.engines[i].url, version, f.exception())
    if len(errors) == len(self.engines):
      raise VllmError("no vLLM server took the new weights: " + " | ".join(errors))

  def _probe_servers(self, tokens):
    """Every server that took the weights scores the probe, concurrently."""
    live = [e for e, v in zip(self.engines, self.versions) if v == self._target]
    return list(self._pool.map(lambda e: (e.url, e.score_prompt(tokens)), live))

  def _sample(self, prompts, fields):
    """Each live server samples a contiguous share; a failed share is redone on the servers still up."""
    target = self._version
    live = [i for i, v in enumerate(self.versions) if v == target]
    out: list = [None] * len(prompts)
    todo = list(range(len(prompts)))
    counts: dict[int, int] = {}
    while todo:
      if not live:
        raise VllmError(f"every vLLM server failed ({', '.join(self.urls)}); {len(todo)} of {len(prompts)} prompts"
                        " were not sampled. See each server's log.")
      parts = [(i, [todo[j] for j in share]) for i, share in zip(live, shares(len(todo), len(live))) if len(share)]
      futures = {self._pool.submit(self.engines[i]._sample, [prompts[j] for j in idx],  # noqa: SLF001
                                   [fields[j] for j in idx]): (i, idx) for i, idx in parts}
      todo = []
      for f in cf.as_completed(futures):
        i, idx = futures[f]
        if f.exception() is None:
          for j, r in zip(idx, f.result()):
            out[j] = r
          counts[i] = counts.get(i, 0) + len(idx)
        else:
          log.warning("vLLM server %s failed on %d prompts (%s); sampling them on the other servers",
                      self.engines[i].url, len(idx), f.exception())
          self.versions[i] = None  # out until a sync reaches it again
          live.remove(i)
          todo += idx
      todo.sort()
    self.served = [{"url": self.engines[i].url, "prompts": n, "version": target} for i, n in sorted(counts.items())]
    return out

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
    for e in self.engines:
      e.close()
    super().close()
