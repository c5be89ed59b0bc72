"""The vLLM server section of the training config (`rollout.vllm`, and a served teacher's `teacher.vllm`):
one frozen dataclass, validated where it is built (opdjax.config.schema). Its own module as two sections
use it."""

from __future__ import annotations

import dataclasses
import shlex

from opdjax.errors import UserError


def check_positive(key: str, value, minimum=1) -> None:
  if value < minimum:
    raise UserError(f"{key}={value}: must be >= {minimum}.")


@dataclasses.dataclass(frozen=True)
class VllmConfig:
  """rollout.engine='vllm': a vLLM server (started here, or `url` to attach) samples; weights are
  synced every step. quantization / kv_cache_dtype ('fp8') need a GPU. `extra_args`: more
  `vllm serve` flags, shell-quoted (e.g. '--max-num-seqs 128'). Several servers: `urls` (attach,
  comma-separated) or `num_servers` (started here, `tensor_parallel_size` GPUs each, taken in order
  from `gpus` when given): prompts are spread across them (opdjax.rollout.vllm.multi). `dtype` 'auto' and
  `enforce_eager` None (auto): bf16 with CUDA graphs for servers on a GPU, fp32 and eager on CPU, chosen
  once at start-up for the servers opdjax starts (opdjax.rollout.vllm.gpu_defaults.resolve); an attached
  server runs what it was started with."""

  url: str = ""
  urls: str = ""
  num_servers: int = 1
  gpus: str = ""
  cpus: str = ""  # rollout.placement=disaggregated: the server's own cores on CPU (opdjax.rollout.deploy)
  dtype: str = "auto"
  quantization: str = ""
  kv_cache_dtype: str = ""
  gpu_memory_utilization: float = 0.0
  tensor_parallel_size: int = 1
  enforce_eager: bool | None = None  # None: auto (bool records of older runs load as they are)
  api_key: str = ""
  python: str = ""
  cpu_kvcache_gib: int = 1
  extra_args: str = ""
  recipe: str = ""  # recipe.json of `opdjax sensitivity` (or its view): FP8 weights and KV (rollout.vllm.recipe)
  # Synced weights: a folder every trainer process and server host sees ('': OUT/vllm-weights, or /dev/shm
  # for one trainer process and its own server); after each reload a probe whose log-probs may differ
  # from the trainer's by probe_tolerance (0: the default of the server's dtype, opdjax.rollout.vllm.probe).
  export_dir: str = ""
  probe_tolerance: float = 0.0
  # teacher.vllm only, behind trainer processes on several hosts: each host's first process starts its own
  # num_servers servers (or takes its share of `urls`) and that host's processes score against them.
  per_host: bool = False

  @property
  def attached(self) -> tuple[str, ...]:
    """The running servers opdjax attaches to (`urls`, else `url`); () when it starts its own. The one
    reading of `url`/`urls`."""
    urls = tuple(u.strip() for u in self.urls.split(",") if u.strip())
    return urls or ((self.url.strip(),) if self.url.strip() else ())

  @property
  def gpu_ids(self) -> tuple[str, ...]:
    """`gpus` as a list ('0,1' -> ('0', '1'))."""
    return tuple(g.strip() for g in self.gpus.split(",") if g.strip())

  def check(self, section: str = "rollout.vllm"):
    if self.per_host and section != "teacher.vllm":
      raise UserError(f"{section}.per_host: only a served teacher's servers are per host (teacher.vllm.per_host);"
                      " the rollout's servers are driven by process 0.")
    check_positive(f"{section}.tensor_parallel_size", self.tensor_parallel_size)
    check_positive(f"{section}.num_servers", self.num_servers)
    if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
      raise UserError(f"{section}.enforce_eager={self.enforce_eager!r}: give true, false, or auto (None: CUDA graphs"
                      " on a GPU, eager on CPU).")
    if not self.probe_tolerance >= 0:
      raise UserError(f"{section}.probe_tolerance={self.probe_tolerance}: give a log-prob difference > 0, or 0 for"
                      " the default of the server's dtype.")
    if self.urls.strip(",").strip() and (self.url or self.num_servers > 1):
      raise UserError(f"{section}.urls={self.urls!r} attaches to running servers; leave {section}.url empty and"
                      f" {section}.num_servers=1 (it counts servers opdjax starts), or give the one url alone.")
    if self.url and self.num_servers > 1:
      raise UserError(f"{section}.url={self.url!r} with {section}.num_servers={self.num_servers}: list the"
                      f" running servers in {section}.urls, or leave url empty to start num_servers here.")
    gpus = self.gpu_ids
    if gpus and len(gpus) != self.num_servers * self.tensor_parallel_size:
      need = self.num_servers * self.tensor_parallel_size
      raise UserError(f"{section}.gpus={self.gpus!r} lists {len(gpus)} GPUs; {self.num_servers} server(s) x"
                      f" tensor_parallel_size={self.tensor_parallel_size} need {need}.")
    try:
      shlex.split(self.extra_args)
    except ValueError as e:
      raise UserError(f"{section}.extra_args={self.extra_args!r}: {e}; quote it as for a shell.") from None
    if self.recipe:
      from opdjax.rollout.vllm.recipe import check_config

      check_config(self)
