"""Are two XLA:CPU host devices of one process two cores? The evidence for the disaggregated placement.

A jitted chain of matmuls (`--size` square fp32, `--steps` a call, `--calls` calls) runs, each case in a
fresh subprocess with XLA_FLAGS='--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'
(`--flags default`: XLA's own threading):

  one_device     one process, 2 host devices, the chain on device 0 alone
  serial         the same process's devices 0 then 1, one after the other
  two_threads    two Python threads at once, one driving device 0, the other device 1
  one_pinned     one process pinned to one core (os.sched_setaffinity), 1 host device
  two_pinned     two such processes at once, pinned to different cores

Each reports wall seconds, process CPU seconds (getrusage: every thread of the process, XLA's
included) and the threads that burned CPU (/proc/self/task/*/stat), so a side's CPU is measured
where XLA runs it, not on the Python thread that dispatched it. `parallel_speedup` = 2 x the one-side
wall / the two-side wall: 2 when the two sides really run on two cores, 1 when they take turns.
CPU seconds per wall second says how many cores a side holds (1.0: one core; ~2 on 2 cores: one side
spreads over both, so a second side has no idle core to use). Wall clocks are only honest on an
idle box: the load average is printed with the result; CPU seconds hold under load.

  PYTHONPATH=. python bench/core_split.py [--size 512 --steps 8 --calls 10] [--flags single|default]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

SINGLE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
CASES = ("one_device", "serial", "two_threads", "one_pinned", "two_pinned")
RESULT = "RESULT "


# --- child -------------------------------------------------------------------------------------

def _thread_cpu() -> dict[int, float]:
  """CPU seconds of every thread of this process (utime + stime)."""
  tick, out = os.sysconf("SC_CLK_TCK"), {}
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    except (OSError, IndexError, ValueError):
      continue  # a thread that ended meanwhile
  return out


def _cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def child(case: str, size: int, steps: int, calls: int, start_at: float) -> dict:
  import jax
  import jax.numpy as jnp

  @jax.jit
  def chain(x, w):
    return jax.lax.fori_loop(0, steps, lambda i, y: jnp.tanh(y @ w), x)

  devices = jax.devices()
  key = jax.random.key(0)
  args = {d: jax.device_put((jax.random.normal(key, (size, size)), jax.random.normal(key, (size, size)) / size**0.5),
                            d) for d in devices}

  def work(d):
    x, w = args[d]
    for _ in range(calls):
      x = chain(x, w)
    jax.block_until_ready(x)

  for d in devices[:2]:  # compile (one executable a device) and warm up outside the clock
    jax.block_until_ready(chain(*args[d]))
  if start_at:  # two pinned processes start together
    time.sleep(max(0.0, start_at - time.time()))
  threads0, cpu0, t0 = _thread_cpu(), _cpu(), time.perf_counter()
  if case in ("one_device", "one_pinned", "two_pinned"):
    work(devices[0])
  elif case == "serial":
    work(devices[0])
    work(devices[1])
  elif case == "two_threads":
    ts = [threading.Thread(target=work, args=(d,)) for d in devices[:2]]
    for t in ts:
      t.start()
    for t in ts:
      t.join()
  wall = time.perf_counter() - t0
  cpu = _cpu() - cpu0
  threads1 = _thread_cpu()
  busy = sorted((threads1[t] - threads0.get(t, 0.0) for t in threads1), reverse=True)
  return {"case": case, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "cpu_per_wall": round(cpu / wall, 3),
          "busiest_threads_cpu_s": [round(b, 2) for b in busy[:4]],
          "threads_over_10pct_of_wall": sum(b > 0.1 * wall for b in busy),
          "affinity": sorted(os.sched_getaffinity(0)), "devices": len(devices)}


# --- parent ------------------------------------------------------------------------------------

def _spawn(case: str, args, cores: list[int] | None, start_at: float = 0.0) -> subprocess.Popen:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1" if cores else "2"}
  if args.flags == "single":
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + SINGLE).strip()
  cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--size", str(args.size), "--steps",
         str(args.steps), "--calls", str(args.calls), "--start-at", repr(start_at)]
  # Pinned before the child starts, so XLA sizes its thread pools from the mask.
  pre = (lambda c=tuple(cores): os.sched_setaffinity(0, c)) if cores else None
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, preexec_fn=pre)


def _result(p: subprocess.Popen) -> dict:
  out, _ = p.communicate()
  lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
  if p.returncode or not lines:
    raise SystemExit(f"a child failed (exit {p.returncode}):\n{out}")
  return json.loads(lines[-1][len(RESULT):])


LABELS = {"one_device": "one device", "serial": "devices 0 then 1", "two_threads": "two threads, devices 0 and 1",
              "one_pinned": "one process pinned to a core", "two_pinned": "two processes pinned apart"}


def markdown(res: dict) -> str:
  """docs/async.md's table and line (and this bench's printout): per case its wall and CPU seconds, the cores it
  held, its busiest threads; then the parallel speedups."""
  rows = [[label, f"{c['wall_s']:.2f}", f"{c['cpu_s']:.2f}", f"{c['cpu_per_wall']:.2f}",
           ", ".join(f"{b:g}" for b in c["busiest_threads_cpu_s"]) if "busiest_threads_cpu_s" in c
           else "(" + ", ".join(f"{side['cpu_s']:.2f}" for side in c["sides"]) + " a side)"]
          for case, label in LABELS.items() if (c := res["cases"].get(case))]
  from opdjax.analyses import reporting  # PYTHONPATH=. as the command runs

  head = [f"case ({'single-thread XLA flags' if res['flags'] else 'XLA defaults'})", "wall s", "CPU s",
          "CPU s / wall s", "CPU s of the busiest threads"]
  return (reporting.markdown_table(rows, head) + "\n\nWall-clock parallel speedups:"
          f" {res['parallel_speedup_two_threads']:.2f} for two threads and {res['parallel_speedup_two_pinned']:.2f}"
          " for two pinned processes (2 = two cores).")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size", type=int, default=512)
  ap.add_argument("--steps", type=int, default=8, help="matmuls a jitted call")
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument("--flags", choices=("single", "default"), default="single")
  ap.add_argument("--cases", default=",".join(CASES))
  ap.add_argument("--json", help="write the results here too")
  ap.add_argument("--child", help=argparse.SUPPRESS)
  ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print(RESULT + json.dumps(child(args.child, args.size, args.steps, args.calls, args.start_at)), flush=True)
    return 0

  cores = sorted(os.sched_getaffinity(0))
  load0 = os.getloadavg()
  results = {}
  for case in args.cases.split(","):
    if case in ("one_pinned", "two_pinned") and len(cores) < 2:
      print(f"{case}: skipped, this process may use {len(cores)} core(s)", file=sys.stderr)
      continue
    if case == "two_pinned":
      start = time.time() + 8.0  # both children imported JAX and compiled by then (longer under load)
      ps = [_spawn(case, args, [c], start) for c in cores[:2]]
      rs = [_result(p) for p in ps]
      results[case] = {"wall_s": max(r["wall_s"] for r in rs), "cpu_s": round(sum(r["cpu_s"] for r in rs), 3),
                       "sides": rs}
      results[case]["cpu_per_wall"] = round(results[case]["cpu_s"] / results[case]["wall_s"], 3)
    else:
      results[case] = _result(_spawn(case, args, cores[:1] if case == "one_pinned" else None))
    r = results[case]
    print(f"{case:<12} wall {r['wall_s']:7.3f} s  cpu {r['cpu_s']:7.3f} s  cpu/wall {r['cpu_per_wall']:5.2f}"
          + (f"  busiest threads {r['busiest_threads_cpu_s']}" if "busiest_threads_cpu_s" in r else
             f"  per side cpu/wall {[s['cpu_per_wall'] for s in r['sides']]}"), flush=True)

  def speedup(one, two):
    if one in results and two in results:
      return round(2 * results[one]["wall_s"] / results[two]["wall_s"], 3)
    return None

  summary = {"flags": SINGLE if args.flags == "single" else "", "size": args.size, "steps": args.steps,
             "calls": args.calls, "cpu_count": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load0],
             "loadavg_after": [round(x, 2) for x in os.getloadavg()],
             "parallel_speedup_two_threads": speedup("one_device", "two_threads"),
             "serial_over_one_device": (round(results["serial"]["wall_s"] / results["one_device"]["wall_s"], 3)
                                        if "serial" in results and "one_device" in results else None),
             "parallel_speedup_two_pinned": speedup("one_pinned", "two_pinned"), "cases": results}
  print(f"load average {summary['loadavg_before']} -> {summary['loadavg_after']}")
  if summary["parallel_speedup_two_threads"] and summary["parallel_speedup_two_pinned"]:
    print(markdown(summary))
  print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
