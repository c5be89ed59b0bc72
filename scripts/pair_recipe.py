"""Your own pair learns: the CPU recipe of the README's "Distill your own pair" (SmolLM2-135M-Instruct as the
teacher, a cut of it as the student, configs/smollm2_opd.py) over several seeds, judged from both sides.

  python scripts/pair_recipe.py --out runs/pair [--seeds 0,1,2] [--set KEY=VALUE ...]

Runs `opdjax train --config configs/smollm2_opd.py` once a seed (`seed=S`, every run's own folder
OUT/seedS; the seeds run side by side as far as memory allows, `--jobs`; the same command resumes unfinished
runs), then reads each run's
metrics.jsonl: the held-out reverse KL on the student's own samples, and from the teacher's side the
student's per-token NLL on the teacher's greedy completions (`teacher_nll`) and the token F1 of its greedy
answers against the teacher's (`teacher_f1`, opdjax.pipeline.heldout); the collapse guard's signals
(entropy, distinct-token share, longest repeated n-gram) and its events; two samples of the last step with
the teacher's own completion beside them. Per measure: the change first -> last evaluation per seed, its
mean and a 95% t-interval across seeds. The verdict `closer` holds when every interval lies on the side of
getting closer (reverse KL and NLL down, F1 up) and the collapse guard fired no event (the length guard's
events are reported beside it); it could fail (the project's
previous recipe, every other layer at lr 1e-5, raised the NLL 13.5 -> 17.7 while entropy fell 4.06 -> 0.15).

Writes OUT/pair_recipe.json: the settings, per seed the curve and the changes, the intervals, the
verdict, wall seconds, and the 1-minute load at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURES = {"reverse_kl": -1, "teacher_nll": -1, "teacher_f1": +1}  # the direction of getting closer
LABELS = {"reverse_kl": "held-out reverse KL, own samples", "teacher_nll": "NLL on the teacher's answers",
          "teacher_f1": "token F1 against the teacher"}
SIGNALS = ("entropy", "distinct_frac", "repeat_ngram_frac", "completion_len_mean", "eos_frac")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def interval(x) -> dict:
  """Mean and 95% t-interval of `x` (one value a seed)."""
  x = np.asarray(x, float)
  half = T95.get(len(x) - 1, 1.96) * x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else float("nan")
  return {"mean": float(x.mean()), "low": float(x.mean() - half), "high": float(x.mean() + half),
          "values": [float(v) for v in x]}


PEAK_GIB = 9  # one seed's peak resident memory (8.4 GB measured, 16 held-out prompts): three side by side were
# OOM-killed on the 23 GiB box (2026-12-06)


def default_jobs(n: int) -> int:
  """Seeds run side by side: as many as the available memory holds at PEAK_GIB each (at least one)."""
  avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30  # free; MemAvailable below if read
  try:
    avail = int(next(line for line in open("/proc/meminfo") if line.startswith("MemAvailable")).split()[1]) / 2**20
  except (OSError, StopIteration):
    pass
  return max(1, min(n, int(avail // PEAK_GIB)))


def run_seeds(out: str, seeds: list[int], sets: list[str], jobs: int) -> None:
  """At most `jobs` seeds at once; the next starts when the oldest running one ends."""
  pending, procs = list(seeds), []
  while pending or procs:
    while pending and len(procs) < jobs:
      procs.append(_start(out, pending.pop(0), sets))
    s, p = procs.pop(0)
    if p.wait():
      for _, q in procs:
        q.kill()
      raise SystemExit(f"seed {s} exited {p.returncode}: see {out}/seed{s}.log")


def _start(out: str, s: int, sets: list[str]):
  folder = os.path.join(out, f"seed{s}")
  cmd = [sys.executable, "-m", "opdjax.cli", "train", "--config", "configs/smollm2_opd.py", "--out", folder,
         f"--config.seed={s}", "--config.train.log_samples_every=5"] + [f"--config.{kv}" for kv in sets]
  log = open(os.path.join(out, f"seed{s}.log"), "a")
  env = {**os.environ, "PYTHONPATH": ROOT}
  return s, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def read_seed(folder: str) -> dict:
  recs = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
  evals = [r for r in recs if r.get("eval_step", r["step"]) == r["step"] and "teacher_nll" in r]
  curve = [{"step": r["step"], **{k: r[k] for k in MEASURES}} for r in evals]
  signals = {k: [round(r[k], 4) for r in recs if k in r] for k in SIGNALS}
  events = [{"step": r["step"], "event": r[k]} for r in recs for k in ("collapse_guard_event", "length_guard_event")
            if k in r]
  samples = [json.loads(line) for line in open(os.path.join(folder, "samples.jsonl"))]
  last = [s for s in samples if s["step"] == samples[-1]["step"]][:2] if samples else []
  return {"curve": curve, "change": {k: curve[-1][k] - curve[0][k] for k in MEASURES}, "signals": signals,
          "events": events, "samples": [{k: s.get(k) for k in ("step", "prompt", "completion", "teacher_completion")}
                                        for s in last]}


def closer(changes: dict) -> dict[str, bool]:
  """Per measure: its 95% interval of the change across seeds lies on the side of getting closer."""
  return {k: (changes[k]["high"] < 0 if d < 0 else changes[k]["low"] > 0) for k, d in MEASURES.items()}


def _events(res: dict, guard: str) -> int:
  """The `guard` guard's events over every seed. The verdict's collapse signal is the collapse guard's: the length
  guard's events say completions hit rollout.max_new_tokens, as the teacher's own answers do at this cap."""
  return sum(e["event"].startswith("collapse") == (guard == "collapse") for run in res["runs"].values()
             for e in run["events"])


def markdown(res: dict) -> str:
  """The README's paragraph and table (and this script's printout), the verdict derived again from the intervals:
  closer on a measure when its interval excludes no change; the run as a whole, on all three with no collapse."""
  from opdjax.analyses import reporting

  ok, collapses = closer(res["changes"]), _events(res, "collapse")
  shown, missing = ([LABELS[k] for k, v in ok.items() if v == want] for want in (True, False))
  verdict = ("closer on all three measures, no collapse event" if not missing and not collapses else
             f"closer on {', '.join(shown) or 'no measure'}; not shown on {', '.join(missing) or 'none'} (95% interval"
             f" across seeds includes no change); {collapses} collapse event(s)")
  rows = []
  for k, label in LABELS.items():
    first, last = ([run["curve"][i][k] for run in res["runs"].values()] for i in (0, -1))
    c = res["changes"][k]
    rows.append([label, f"{sum(first) / len(first):.3f}", f"{sum(last) / len(last):.3f}",
                 f"{c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]", "closer" if ok[k] else "not shown"])
  rows += [[f"{g} guard events (all seeds)", "", "", str(n), "fired" if n else "none"]
           for g, n in ((g, _events(res, g)) for g in ("collapse", "length"))]
  step0 = next(iter(res["runs"].values()))["curve"][0]["step"]
  return (f"Over {len(res['runs'])} seeds: {verdict}.\n\n" + reporting.markdown_table(
      rows, ["measure (mean of seeds)", f"step {step0}", f"step {res['settings']['train.steps']}",
             "change, 95% interval across seeds", "verdict"]))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="a config override for every seed (e.g. optim.learning_rate=3e-5)")
  ap.add_argument("--jobs", type=int, default=0,
                  help=f"seeds run side by side (default: as many as the available memory holds, {PEAK_GIB} GiB each)")
  args = ap.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  jobs = args.jobs or default_jobs(len(seeds))
  os.makedirs(args.out, exist_ok=True)
  load0, t0 = os.getloadavg()[0], time.time()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()  # what the runs import: read before they start
  dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
  run_seeds(args.out, seeds, args.set, jobs)
  runs = {s: read_seed(os.path.join(args.out, f"seed{s}")) for s in seeds}
  changes = {k: interval([runs[s]["change"][k] for s in seeds]) for k in MEASURES}
  ok = closer(changes)
  events = sum(len(r["events"]) for r in runs.values())
  collapse = _events({"runs": runs}, "collapse")
  config = json.load(open(os.path.join(args.out, f"seed{seeds[0]}", "config.json")))
  result = {
      "settings": {"config": "configs/smollm2_opd.py", "overrides": args.set, "seeds": seeds,
                   "student.keep_layers": config["student"]["keep_layers"],
                   "optim.learning_rate": config["optim"]["learning_rate"], "loss.kind": config["loss"]["kind"],
                   "train.steps": config["train"]["steps"], "rollout.batch_size": config["rollout"]["batch_size"],
                   "rollout.max_new_tokens": config["rollout"]["max_new_tokens"],
                   "task.num_eval": config["task"]["num_eval"]},
      "runs": {str(s): r for s, r in runs.items()}, "changes": changes, "closer": ok, "events": events,
      "collapse_events": collapse,
      "verdict": "closer" if all(ok.values()) and not collapse else "not shown",
      "wall_s": round(time.time() - t0, 1), "load_average": {"start": round(load0, 1),
                                                             "end": round(os.getloadavg()[0], 1)},
      "commit": commit + ("+modified" if dirty else ""), "date": time.strftime("%Y-%m-%d"),
  }
  with open(os.path.join(args.out, "pair_recipe.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(markdown(result))
  return 0


def plot(result: dict, path: str) -> str:
  """The three held-out measures against the step, one line a seed."""
  from opdjax.analyses import reporting

  fig, axes = reporting.figure(1, 3, figsize=(13, 3.8))
  labels = {"reverse_kl": "reverse KL on its own samples (nats/token)",
            "teacher_nll": "NLL on the teacher's answers (nats/token)", "teacher_f1": "token F1 against the teacher"}
  for i, (seed, run) in enumerate(result["runs"].items()):
    steps = [p["step"] for p in run["curve"]]
    for ax, key in zip(axes, MEASURES):
      ax.plot(steps, [p[key] for p in run["curve"]], marker="o", color=f"C{i}", label=f"seed {seed}")
  for ax, key in zip(axes, MEASURES):
    ax.set_xlabel("step")
    ax.set_ylabel(labels[key], fontsize=8)
    ax.legend(fontsize=8)
  return reporting.save_figure(fig, path)


if __name__ == "__main__":
  raise SystemExit(main())
