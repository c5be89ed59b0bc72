"""GPU start-up decisions, as pure functions of what the machine shows: which GPUs are visible, how a
trainer and a vLLM server sharing one split its memory, what each pytest worker may take, and the
refusal to train on CPU JAX on a GPU node.

Everything here must run before JAX initialises a backend (the memory fractions are read once, at
initialisation), so nothing here imports a backend or calls `jax.devices()`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

from opdjax.errors import UserError

GPU_INSTALL = "pip install -e '.[gpu]'"
# vLLM's --gpu-memory-utilization when a server shares the trainer's GPU and none is configured:
# vLLM's own default (0.9) leaves JAX nothing, and vLLM refuses to start when less is free.
SHARED_VLLM_UTILIZATION = 0.45
# Left to neither side: the CUDA context of each process, cuBLAS/cuDNN workspaces, NCCL buffers.
SHARED_MARGIN = 0.05
JAX_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


def visible_gpus(env: Mapping[str, str] | None = None, dev_glob: str = "/dev/nvidia[0-9]*") -> int:
  """How many NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES when set (empty or -1: none),
  else the /dev/nvidiaN device files (no nvidia-smi call: this runs at every start)."""
  env = os.environ if env is None else env
  listed = env.get("CUDA_VISIBLE_DEVICES")
  if listed is not None:
    ids = [x.strip() for x in listed.split(",") if x.strip()]
    return 0 if not ids or ids[0] == "-1" else len(ids)
  return len(glob.glob(dev_glob))


def config_wants_gpu(cfg) -> str | None:
  """What in a training config asks for a GPU (None: nothing does). bf16 / fp16 compute is what the
  GPU configs set (configs/qwen3_*.py); on CPU it is emulated and slower than fp32."""
  if cfg.model.dtype != "float32":
    return f"model.dtype={cfg.model.dtype}"
  if cfg.rollout.server_gpu_ids:
    return f"rollout.vllm.gpus={cfg.rollout.vllm.gpus!r}"
  return None


def check_jax_backend(backend: str, gpus: int, wants: str | None, env: Mapping[str, str] | None = None) -> None:
  """Refuses a run that would train on CPU JAX on a GPU node (CPU-only jax installed, e.g. by the
  `vllm` extra): one line naming the install. JAX_PLATFORMS=cpu set by the user is a choice, not a
  mistake. `backend`: `jax.default_backend()`; `gpus`: `visible_gpus()`; `wants`: `config_wants_gpu`."""
  env = os.environ if env is None else env
  if backend != "cpu" or gpus == 0 or wants is None or env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return
  raise UserError(f"{gpus} GPU(s) visible and the config asks for one ({wants}), but JAX has only its CPU backend:"
                  f" install CUDA JAX with `{GPU_INSTALL}` (or set JAX_PLATFORMS=cpu to train on the CPU anyway).")


def check_cpu_dtype(backend: str, dtype: str) -> None:
  """Refuses bf16 compute on XLA:CPU before anything loads: its dot thunk has no BF16 x BF16 = F32 kernel, so
  the first train step would die after the models loaded and the step-0 evaluation ran. `backend`:
  `jax.default_backend()`; `dtype`: `model.dtype`."""
  if backend == "cpu" and dtype != "float32":
    raise UserError(f"model.dtype={dtype} cannot train on JAX's CPU backend (XLA:CPU has no {dtype} matmul with"
                    " float32 accumulation): pass --config.model.dtype=float32 on CPU.")


def shared_gpu_memory(vllm_utilization: float, env: Mapping[str, str] | None = None) -> tuple[float, dict[str, str]]:
  """A trainer and a vLLM server on one GPU: `(vLLM's --gpu-memory-utilization, the environment the
  trainer's JAX must start with)`. vLLM takes utilization u of the whole GPU (0: SHARED_VLLM_UTILIZATION);
  JAX a fraction f <= 1 - u - SHARED_MARGIN, derived when the environment sets none. A fraction the
  environment sets that does not fit (the launchers' 0.9) is refused, naming both knobs."""
  env = os.environ if env is None else env
  u = vllm_utilization or SHARED_VLLM_UTILIZATION
  room = round(1.0 - u - SHARED_MARGIN, 2)
  if not 0 < u < 1 or room < 0.1:
    raise UserError(f"rollout.vllm.gpu_memory_utilization={u} leaves the trainer's JAX {max(room, 0):.2f} of the GPU"
                    f" they share; give vLLM at most {1 - SHARED_MARGIN - 0.1:.2f}, or the server GPUs of its own"
                    " (rollout.vllm.gpus).")
  given = env.get(JAX_FRACTION_ENV)
  if given is None:
    return u, {JAX_FRACTION_ENV: f"{room:.2f}"}
  try:
    f = float(given)
  except ValueError:
    raise UserError(f"{JAX_FRACTION_ENV}={given!r} is not a number; give a fraction such as {room:.2f}.") from None
  if f + u > 1.0 - SHARED_MARGIN + 1e-9:
    raise UserError(f"{JAX_FRACTION_ENV}={given} for the trainer's JAX and rollout.vllm.gpu_memory_utilization={u} for"
                    f" the vLLM server sharing its GPU exceed {1 - SHARED_MARGIN:.2f} together: lower one of them"
                    f" (e.g. {JAX_FRACTION_ENV}={room:.2f}), or give the server GPUs of its own (rollout.vllm.gpus).")
  return u, {}


def apply_before_jax(env_updates: Mapping[str, str], initialized: bool | None = None) -> None:
  """Sets `env_updates` in this process's environment, which JAX reads when it first starts a
  backend; refused once it has (the fractions would silently not apply)."""
  if not env_updates:
    return
  if initialized is None:
    from jax._src import xla_bridge

    initialized = xla_bridge.backends_are_initialized()
  if initialized:
    raise UserError(f"{', '.join(f'{k}={v}' for k, v in env_updates.items())} must be set before JAX starts; export"
                    " it before running opdjax.")
  os.environ.update(env_updates)


def worker_memory_env(workers: int, gpus: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
  """What a pytest-xdist worker sets before its JAX starts when `workers` share the visible GPUs:
  no preallocation and an equal share each (JAX's 75% each made the second worker fail to allocate).
  Nothing without GPUs, for one worker, or where the environment already says."""
  env = os.environ if env is None else env
  if gpus == 0 or workers <= 1:
    return {}
  out = {}
  if JAX_PREALLOCATE_ENV not in env:
    out[JAX_PREALLOCATE_ENV] = "false"
  if JAX_FRACTION_ENV not in env:
    out[JAX_FRACTION_ENV] = f"{(1.0 - SHARED_MARGIN) / workers:.2f}"
  return out
