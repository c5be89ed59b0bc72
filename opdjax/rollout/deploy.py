"""Where and how the rollout engine runs, decided once per run: a frozen `Deployment`.

`plan(cfg)` reads `rollout.*` (and the mesh) and runs every start-up check that needs no model and no
output folder, so a refused run has written nothing: the JAX engine's own devices (`rollout.devices`,
split from the trainer's mesh), the cores of a disaggregated engine (`rollout.placement`, split once
here), the servers attached to (their URLs' form, and that each answers as opdjax needs) or started
here (FP8 needs FP8 GPUs), what a multi-process trainer cannot do. `build(...)` makes the engine the
Deployment describes; `Deployment.engine_side(...)` says where the asynchronous producer's JAX
engine samples and `check_memory` whether the versions it keeps fit there.

This is the one module that asks which engine a run has (besides the config's own validation):
everything above it (Session, EnginePool, AsyncSampler, run.train, distributed) reads the
Deployment, and everything below it speaks the engine protocol of opdjax.rollout.base.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import numpy as np

from opdjax.errors import UserError
from opdjax.models.decoder import Model
from opdjax.parallel.devices import NO_DEVICES, engine_devices, parse
from opdjax.parallel.devices import split as split_devices
from opdjax.parallel.gpu import SHARED_VLLM_UTILIZATION, apply_before_jax, shared_gpu_memory, visible_gpus
from opdjax.parallel.placement import Placement
from opdjax.parallel.rules import param_shardings
from opdjax.rollout.base import RolloutEngine
from opdjax.rollout.cores import CoreSplit, allowed_cpus, format_cpus, parse_cpus
from opdjax.rollout.jax.cache import EngineCache
from opdjax.rollout.jax.engine import JaxEngine
from opdjax.rollout.vllm import gpu_defaults
from opdjax.rollout.vllm.capability import check_fp8, gpu_capabilities
from opdjax.rollout.vllm.engine import VllmEngineBase
from opdjax.rollout.vllm.launch import check_attached, init_folder, make_vllm_engine, server_on_gpu, untied_head
from opdjax.rollout.vllm.primary import PrimaryEngine
from opdjax.rollout.vllm.teacher import URL_PREFIXES

KINDS = ("jax", "vllm")


@dataclasses.dataclass(frozen=True)
class Deployment:
  """`kind`: the engine (rollout.engine). `rollout`: its config, `rollout.vllm.cpus` filled in with the
  split's server cores, an 'auto' dtype and CUDA graphs of the servers started here resolved
  (`resolve_servers`). `cores`: a disaggregated engine's cores and the trainer's, or None (nothing
  pinned). `trainer_devices` / `engine_devices`: this host's devices of the trainer's mesh and of the
  asynchronous JAX engine when `rollout.devices` gives it its own (None: every device / not chosen).
  `attached`: running vLLM servers attached to (() when opdjax starts its own). `engine_here`: this
  process drives the engine (a vLLM engine lives in process 0 only). `processes`: the trainer's.
  `teacher_served` / `teacher_on_engine`: the teacher scores each rollout on its own vLLM servers / in the
  engine's process (Config.teacher_placement, read by the teacher seam, opdjax.pipeline.teacher; neither: in
  the trainer). `teacher_vllm`: a served teacher's section (None otherwise), resolved as its servers run
  (`serve_teacher` starts them, or attaches to its `attached` URLs)."""

  kind: str
  rollout: object
  cores: CoreSplit | None = None
  trainer_devices: tuple | None = None
  engine_devices: tuple | None = None
  attached: tuple[str, ...] = ()
  engine_here: bool = True
  processes: int = 1
  teacher_served: bool = False
  teacher_on_engine: bool = False  # its hidden states come back with each rollout
  teacher_vllm: object = None

  @property
  def one_engine(self) -> bool:
    """One engine serves every engine-view model (vLLM realises its precision itself); otherwise an
    engine per model, sharing params-only views (opdjax.rollout.jax.cache)."""
    return self.kind == "vllm"

  @property
  def own_process(self) -> bool:
    """The engine samples in processes of its own (servers, or the JAX sidecar): the producer needs no
    device of this process."""
    return self.kind == "vllm" or self.cores is not None

  def engine_side(self, placement: Placement, student_cfg, spec: str) -> EngineSide | None:
    """The asynchronous JAX engine's devices for `rollout.devices=spec` (None when the engine samples
    in processes of its own), checked against the trainer's: they may not overlap it, nor be missing
    on this host."""
    if self.own_process:
      return None
    trainer = placement.devices or [jax.devices()[0]]
    local = jax.local_devices(backend=trainer[0].platform)
    if not spec:
      if placement.sharded:
        raise UserError(NO_DEVICES.format(depth=self.rollout.async_depth or "k", n=len(local)))
      others = [d for d in local if d not in trainer]
      return EngineSide([others[-1] if others else trainer[0]], None)
    devices = engine_devices(spec, local)
    shared = [local.index(d) for d in devices if d in trainer]
    if shared:
      free = [str(i) for i, d in enumerate(local) if d not in trainer]
      what = "the trainer's device" if len(trainer) == 1 else "the trainer's mesh"
      raise UserError(f"rollout.devices={spec!r} overlaps {what} (device(s) {', '.join(map(str, shared))}); the JAX"
                      " engine needs devices of its own to sample while the trainer trains: give it devices out of"
                      f" {','.join(free) or 'none (every device is the trainer s)'}, or build the trainer's mesh"
                      " over the rest (rollout.devices in the run's config).")
    if len(devices) == 1:
      return EngineSide(devices, None)
    return EngineSide(devices, Placement.engine(devices, placement, student_cfg, self.rollout.batch_size))


@dataclasses.dataclass
class EngineSide:
  """Where the producer's JAX engine samples: `devices` (its own), `placement` (its own mesh over
  them; None for one device: the unsharded engine under `jax.default_device`)."""

  devices: list
  placement: Placement | None

  @property
  def device(self):
    return self.devices[0]

  @property
  def key(self):
    """EnginePool's key of its engines."""
    return self.placement if self.placement is not None else self.device

  def shardings(self, params):
    if self.placement is not None:
      return param_shardings(params, self.placement.mesh)
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(self.device), params)


def shares_trainer_gpu(rcfg) -> bool:
  """vLLM servers opdjax starts on the trainer's own GPU(s): none attached, no `rollout.vllm.gpus` of
  their own, and GPUs visible to this process."""
  return rcfg.engine == "vllm" and not rcfg.vllm.attached and not rcfg.vllm.gpu_ids and visible_gpus() > 0


def _shared_utilization(rcfg) -> tuple[float, dict]:
  """(each server's --gpu-memory-utilization, the environment JAX must start with) for servers sharing
  the trainer's GPU: vLLM's default 0.9 would leave JAX nothing (or JAX's 75% would leave vLLM too
  little and it refuses to start); opdjax.parallel.gpu.shared_gpu_memory splits the GPU."""
  v = rcfg.vllm
  each = v.gpu_memory_utilization or SHARED_VLLM_UTILIZATION / v.num_servers
  total, env = shared_gpu_memory(each * v.num_servers)
  return total / v.num_servers, env


def prepare_process(cfg) -> None:
  """What must happen before JAX starts a backend (`opdjax train` calls it first): a trainer sharing its
  GPU with the vLLM servers it starts gets the memory fraction that leaves them theirs. Refused, naming
  both knobs, where the environment's fraction and the servers' utilization do not fit together."""
  if shares_trainer_gpu(cfg.rollout):
    apply_before_jax(_shared_utilization(cfg.rollout)[1])


def resolve_servers(cfg):
  """`cfg` with the 'auto' dtype and CUDA graphs of `rollout.vllm` and `teacher.vllm` chosen for the servers
  opdjax starts from them (gpu_defaults.resolve: bf16 and graphs on a GPU, fp32 and eager on CPU; on a GPU
  as launch.server_on_gpu says). A section no server is started from (the JAX engine's, the trainer's
  teacher, attached servers) keeps 'auto': an attached server runs what it was started with. `opdjax train`
  records the resolved config, so a resumed run compares what its servers ran; `plan` calls it too (a
  no-op then)."""

  def resolved(v, starts_servers: bool):
    if not starts_servers or v.attached or (v.dtype != gpu_defaults.AUTO and v.enforce_eager is not None):
      return v
    return gpu_defaults.resolve(v, server_on_gpu(v))

  r, t = cfg.rollout, cfg.teacher
  return dataclasses.replace(cfg, rollout=dataclasses.replace(r, vllm=resolved(r.vllm, r.engine == "vllm")),
                             teacher=dataclasses.replace(t, vllm=resolved(t.vllm, cfg.teacher_served)))


def plan(cfg) -> Deployment:
  """The run's Deployment, after every start-up check that needs neither models nor an output folder
  (see the module doc). Call it before JAX starts where it can: an asynchronous JAX engine on CPU
  gets a host device of its own."""
  cfg = resolve_servers(cfg)  # every later reader of a section's vllm.dtype / enforce_eager sees the server's
  r = cfg.rollout
  if r.engine not in KINDS:
    raise UserError(f"rollout.engine={r.engine!r}; choose one of {', '.join(repr(k) for k in KINDS)}.")
  jax_async = r.engine == "jax" and bool(r.async_depth)
  if jax_async:
    _host_devices()
  processes = jax.process_count()
  if processes > 1 and (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 1, 1):
    raise UserError(f"mesh data=1 fsdp=1 tensor=1 uses one device, but the run has {processes} processes:"
                    " set the mesh over every device, e.g. --config.mesh.fsdp=-1.")
  trainer_devices, own_devices = split_devices(r, cfg.mesh, own_engine_devices=jax_async)
  cores = core_split(r)
  if cores is not None and r.engine == "vllm":
    r = dataclasses.replace(r, vllm=dataclasses.replace(r.vllm, cpus=format_cpus(cores.server)))
  if shares_trainer_gpu(r):  # the servers' share of the trainer's GPU (prepare_process gave JAX the rest)
    r = dataclasses.replace(r, vllm=dataclasses.replace(r.vllm, gpu_memory_utilization=_shared_utilization(r)[0]))
  engine_here = r.engine == "jax" or jax.process_index() == 0
  attached = r.vllm.attached if r.engine == "vllm" else ()
  if r.engine == "vllm" and engine_here:  # process 0 drives the servers
    if attached:
      check_attached(attached, r.vllm.api_key)
    else:  # servers started here: FP8 needs FP8 GPUs
      v = r.vllm
      check_fp8(v.quantization or ("fp8" if v.recipe else ""), v.kv_cache_dtype, gpu_capabilities(v.gpus))
  return Deployment(r.engine, r, cores, None if trainer_devices is None else tuple(trainer_devices),
                    None if own_devices is None else tuple(own_devices), attached, engine_here, processes,
                    cfg.teacher_served, cfg.teacher_on_engine, _plan_teacher(cfg, processes))


def _plan_teacher(cfg, processes: int):
  """`teacher.vllm` when the teacher is served (None otherwise), after the checks that need no model: the
  attached servers' URLs, log-prob mode and limit (checked by process 0; per_host: the URLs split evenly
  over the hosts), FP8 on FP8 GPUs for servers started here. Behind several processes the servers are
  process 0's (or each host's first process's), shared when they first score (opdjax.pipeline.teacher)."""
  if not cfg.teacher_served:
    return None
  from opdjax.parallel.multihost import hosts
  from opdjax.rollout.vllm.teacher import check_teacher_servers

  v = cfg.teacher.vllm
  if v.per_host and processes > 1:
    n = len(hosts())  # (every process plans: a collective at the same point)
    if v.attached and len(v.attached) % n:
      raise UserError(f"teacher.vllm.per_host with {len(v.attached)} attached URL(s) over {n} hosts: each host's"
                      f" processes score against their own host's servers, so give a multiple of {n} URLs (host"
                      " by host, in process order), or leave per_host off to share every URL.")
  urls = v.attached or tuple(x for _, x in cfg.teacher.route_table if x.startswith(URL_PREFIXES))
  if urls and jax.process_index() == 0:
    check_teacher_servers(urls, v.api_key, topk=objective_topk(cfg), max_len=cfg.rollout.max_len)
  if not v.attached:  # servers started here (the one teacher's, or routes' folders): FP8 needs FP8 GPUs
    check_fp8(v.quantization or ("fp8" if v.recipe else ""), v.kv_cache_dtype, gpu_capabilities(v.gpus))
  return v


def serve_teacher(d: Deployment, cfg, model_dir: str | None, *, vocab_size: int, batch_size: int, out_dir: str,
                  url: str | None = None, token: str | None = None, name: str = "teacher", topk: int | None = None):
  """A served teacher of a Deployment with `teacher_served`: its servers started from `teacher.vllm` (serving
  `model_dir`), or the attached ones (`teacher.vllm.url(s)`, or `url`: a route's, or a comma-separated list of
  another process's servers, with their `token`); `batch_size`: the most rows one scoring sends; `name`: its
  log (OUT/vllm-NAME.log) and its messages; `topk`: the top-K it answers (None: the objective's)."""
  from opdjax.rollout.vllm.teacher import ServedTeacher

  if not d.teacher_served:
    raise ValueError("this Deployment does not serve its teacher (teacher.serve='vllm' does).")
  vcfg = d.teacher_vllm if url is None else dataclasses.replace(d.teacher_vllm, url="", urls=url, num_servers=1)
  return ServedTeacher(vcfg, model_dir, max_len=cfg.rollout.max_len, batch_size=batch_size,
                       topk=objective_topk(cfg) if topk is None else topk, vocab_size=vocab_size,
                       out_dir=out_dir, name=name, token=token)


def objective_topk(cfg) -> int:
  """The top-K a served teacher answers for the objective (topk_rkl's loss.topk; 0: the sampled token only)."""
  return cfg.loss.topk if cfg.loss.kind == "topk_rkl" else 0


def describe_config(rcfg) -> str:
  """What `rollout.devices` does to the layout, for --print-config ('' when it does nothing)."""
  if not (rcfg.async_depth and rcfg.engine == "jax" and rcfg.devices):
    return ""
  kind, vals = parse(rcfg.devices)
  which = f"the last {vals[0]} device(s)" if kind == "count" else f"device(s) {','.join(map(str, vals))}"
  return (f"rollout.devices={rcfg.devices!r}: the asynchronous JAX engine samples on {which} of this host, as its"
          " own mesh; the trainer's mesh (mesh.*) is built over the host's other devices")


def _host_devices() -> None:
  """On CPU, a second host device for the asynchronous producer (one core a side), when JAX has not
  started yet and nothing else chose a device count."""
  from jax._src import xla_bridge

  if (xla_bridge.backends_are_initialized() or jax.config.jax_num_cpu_devices > 1
      or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
    return
  jax.config.update("jax_num_cpu_devices", 2)


def core_split(rcfg, allowed: list[int] | None = None) -> CoreSplit | None:
  """The cores of a disaggregated engine and of the trainer; None when nothing is pinned (colocated;
  attached servers, pinned where they run; GPU servers without `rollout.vllm.cpus`, disaggregated by
  their GPUs). The JAX engine's process takes the upper half; vLLM servers started here take
  `rollout.vllm.cpus`, by default the upper half in whole tensor-parallel ranks. Refused: cores this
  process may not use (beyond the machine's, or outside its affinity mask), a list leaving the
  trainer no core, fewer than two cores for two sides, a list that does not split evenly into the
  servers' ranks."""
  allowed = allowed_cpus() if allowed is None else sorted(allowed)
  if rcfg.placement != "disaggregated":
    return None
  if len(allowed) < 2:
    raise UserError(f"rollout.placement='disaggregated' runs the rollout engine and the trainer on cores of their own:"
                    f" it needs at least 2 cores, this process may use {len(allowed)} ({format_cpus(allowed)}); give"
                    " the job more cores (taskset, SLURM --cpus-per-task) or use rollout.placement=colocated.")
  v = rcfg.vllm
  if rcfg.engine == "jax":  # its own process (opdjax.rollout.jax.sidecar) on the upper half
    half = len(allowed) // 2
    return CoreSplit(allowed[len(allowed) - half:], allowed[:len(allowed) - half])
  if v.attached or (v.gpus and not v.cpus):
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


def jax_engine(model: Model, params=None, *, max_len: int, pad_id: int, eos_ids: Sequence[int], placement=None,
               version: int = 0) -> JaxEngine:
  """The embedded JAX engine for `model` (an engine-view model: compute dtype, KV and activation
  rounding are its config) in this process, outside any run's Deployment (held-out evaluation, the
  analyses); `placement`: rows and KV cache over a mesh, None: one device."""
  return JaxEngine(model, params, max_len=max_len, pad_id=pad_id, eos_ids=tuple(eos_ids), placement=placement,
                   version=version)


def jax_engines(d: Deployment, *, pad_id: int, eos_ids: Sequence[int], placement=None, teacher=None) -> EngineCache:
  """The JAX engines of a JAX Deployment, one per engine-view model: in this process on `placement`
  (a mesh, one device: None), or each in a process of its own on the Deployment's cores."""
  return EngineCache(max_len=d.rollout.max_len, pad_id=pad_id, eos_ids=eos_ids, placement=placement, cores=d.cores,
                     teacher=teacher if d.teacher_on_engine else None)


def build(d: Deployment, student: Model, params, *, pad_id: int, eos_ids: Sequence[int], placement,
          out_dir: str | None, probe_action: str = "error") -> RolloutEngine:
  """The one engine of a `one_engine` Deployment (vLLM), starting from `params` (placed by
  `placement`). With several trainer processes it lives in process 0 behind a `PrimaryEngine`; every
  process calls its `sync` and `generate`. `probe_action`: what a server failing the reload probe is
  (error, warn). JAX Deployments build their engines per model through `jax_engines`."""
  if not d.one_engine:
    raise ValueError(f"a {d.kind} Deployment builds an engine per model: use jax_engines.")
  r = d.rollout
  if out_dir is None:
    raise UserError("rollout.engine='vllm' needs an output folder for the server's log and weights.")

  def make(init_params):
    return make_vllm_engine(r.vllm, student.cfg, init_params, max_len=r.max_len, batch_size=r.batch_size,
                            max_new_tokens=r.max_new_tokens, pad_id=pad_id, eos_ids=eos_ids, out_dir=out_dir,
                            probe_action=probe_action)

  if d.processes > 1:  # one vLLM engine, in process 0, for the trainer's every process
    if not d.attached:  # every process writes its shards of the servers' first weights: no gather
      init_folder(params, student.cfg, out_dir, untie=untied_head(r.vllm, student.cfg))
    return PrimaryEngine(lambda: make(None), placement, VllmEngineBase.capabilities, pad_id)
  return make(params)


def check_memory(side: EngineSide | None, params, depth: int, view) -> None:
  """Exact mode keeps depth + 1 versions on the engine's devices (and their transformed copies, for
  views with noise or quantization), plus the engine's own installed copy."""
  if side is None:
    return
  frees = [free_bytes(d) for d in side.devices]
  if any(f is None for f in frees):
    return
  shardings = side.shardings(params)
  per_device = sum(math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))
  copies = (depth + 1) * (1 if view == type(view)(lag=view.lag) else 2) + 1
  free = min(frees)
  if copies * per_device > free:
    raise UserError(f"rollout.async_depth={depth} keeps {copies} params copies ({copies * per_device / 2**30:.2f} GiB"
                    f" a device) on the engine's device(s), which have {free / 2**30:.2f} GiB free; lower"
                    " rollout.async_depth or give the engine more devices or memory (rollout.devices).")


def free_bytes(device) -> int | None:
  """Free memory of `device` in bytes, None where the runtime does not report it (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 -- not every runtime implements it
    return None
  if not stats or "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
