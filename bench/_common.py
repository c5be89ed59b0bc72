"""Helpers shared by the benchmarks: one subprocess per side, process memory, reports.

Each side (opdjax, PyTorch) runs in its own subprocess so that the two never share
an allocator or a thread pool, and so that the process-level memory measure on CPU
belongs to one framework only. A child prints one `RESULT {json}` line last.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

RESULT_TAG = "RESULT "
CPU_TIME_NOTE = ("tokens/s (CPU time) divides by the process's user+sys seconds instead of wall seconds:"
                 " jobs sharing the box slow the wall clock, not the work")


# --- child side ---------------------------------------------------------------

def pin_cpu_threads(n: int) -> None:
  """Restricts this process to `n` cores; call before importing jax or torch.

  XLA's CPU thread pool and torch's OpenMP pool both size themselves from the
  affinity mask, so both frameworks get the same cores.
  """
  cores = sorted(os.sched_getaffinity(0))[:n]
  os.sched_setaffinity(0, cores)
  for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = str(len(cores))


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
  return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
  return _status_kib("VmHWM") * 1024


def trim_heap() -> None:
  """Returns free malloc heap to the OS (glibc), e.g. what a compiler left behind."""
  import ctypes
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def start_peak_window() -> bool:
  """Trims the heap and restarts the peak-RSS mark (Linux >= 4.0); False if not allowed."""
  trim_heap()
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def timed(fn):
  """`(wall s, process CPU s, fn())`. CPU time stays honest on a box shared with other jobs."""
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn()
  return time.perf_counter() - wall, time.process_time() - cpu, out


def emit(result: dict) -> None:
  print(RESULT_TAG + json.dumps(result), flush=True)


# --- parent side --------------------------------------------------------------

def run_child(script: str, args: list[str], env_extra: dict[str, str] | None = None) -> dict:
  env = {**os.environ, **(env_extra or {})}
  proc = subprocess.run([sys.executable, script, *args], stdout=subprocess.PIPE, text=True, env=env)
  lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
  if proc.returncode or not lines:
    sys.stdout.write(proc.stdout)
    raise SystemExit(f"child {' '.join(args)} failed (exit code {proc.returncode}); see its output above.")
  return json.loads(lines[-1][len(RESULT_TAG):])


ROW_TAGS = ("ROW ", "COMPILED ")  # a child's partial results, one JSON a line, kept if it is cut short


def run_streaming(cmd: list[str], env: dict, limit: float, prefix: str) -> dict:
  """Runs a child under a time limit, echoing its lines (`prefix`ed) as they come: `{"returncode"
  (None when killed at the limit), "result" (its RESULT, or None), "rows": {"ROW": [...], "COMPILED":
  [...]}}`. Rows printed before a timeout or a crash are kept; the child's process group is killed."""
  import signal
  import threading

  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
  got = {"result": None, "rows": {t.strip(): [] for t in ROW_TAGS}}

  def read():
    for line in proc.stdout:
      line = line.rstrip("\n")
      if line.startswith(RESULT_TAG):
        got["result"] = json.loads(line[len(RESULT_TAG):])
        continue
      print(f"  [{prefix}] {line}", flush=True)
      tag = next((t for t in ROW_TAGS if line.startswith(t)), None)
      if tag:
        try:
          got["rows"][tag.strip()].append(json.loads(line[len(tag):]))
        except ValueError:
          pass

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    got["returncode"] = proc.wait(timeout=max(limit, 1))
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    got["returncode"] = None
  reader.join(timeout=10)
  return got


def command_line() -> str:
  return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def cpu_description() -> str:
  mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  return f"{os.cpu_count()}-core {platform.machine()} CPU, {mem_gib:.0f} GiB"


def machine() -> str:
  """The machine a result was measured on, for its result file: the accelerator jax runs on (its
  device kind and jax version; none on a CPU backend) and the host. Call after importing jax."""
  import jax

  dev = jax.devices()[0]
  host = cpu_description()
  if dev.platform == "cpu":
    return f"{host}, jax {jax.__version__} (CPU backend)"
  return f"{dev.device_kind} ({dev.platform}, jax {jax.__version__}); host {host}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
  out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  out += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(out)


def append_markdown(path: str, title: str, machine: str, notes: list[str], table: str, ratio: str,
                    summary: dict) -> None:
  date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
  text = [f"## {title}", "", f"- Date: {date}", f"- Machine: {machine}",
          f"- Command: `PYTHONPATH=. python {command_line()}`"]
  text += [f"- {n}" for n in notes]
  text += ["", table, "", f"**{ratio}**", "", f"`{json.dumps(summary)}`", ""]
  with open(path, "a") as f:
    f.write("\n".join(text) + "\n")


def report(title: str, args, device: str, notes: list[str], table: str, ratio_line: str, summary: dict) -> None:
  """Prints a benchmark's result and, with --out, appends it as a markdown section."""
  print(f"\n{title}, mode {args.mode} ({device})")
  for n in notes:
    print(f"  {n}")
  print(table)
  print(ratio_line)
  print(json.dumps(summary))
  if args.out:
    machine = args.machine or (device if args.mode == "gpu" else cpu_description())
    if args.mode == "cpu":
      machine += f"; each side pinned to {args.threads} core(s)"
    append_markdown(args.out, f"{title} ({args.mode})", machine, notes, table, ratio_line, summary)


# Dense (no sparsity) peak bf16/fp16 tensor-core FLOP/s from the vendors' datasheets; first match
# of the device kind wins. MFU is measured against these.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H200", 989.4e12), ("H100", 989.4e12), ("H800", 989.4e12),
                   ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12))


def peak_flops(device_kind: str, dtype: str) -> float | None:
  """The device's peak FLOP/s for `dtype` compute, or None (unknown device, or fp32 / CPU)."""
  if dtype not in ("bfloat16", "float16"):
    return None
  return next((f for name, f in PEAK_BF16_FLOPS if name in device_kind), None)


def torch_device(mode: str):
  """The torch device for a bench side: CUDA in gpu mode (an error without one), else the CPU
  with torch's thread pool sized to this process's cores."""
  import torch

  if mode == "gpu":
    if not torch.cuda.is_available():
      raise SystemExit("--mode gpu needs a CUDA build of torch with a visible GPU.")
    return torch.device("cuda")
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  return torch.device("cpu")
