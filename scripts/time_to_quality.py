"""Time to quality: does overlapping sampling with training (and FP8 rollouts) reach the target sooner?

Runs the demo (configs/demo.py) in these configurations, `--seeds` seeds each, on one Session a
placement (every function compiled once, warmed up before any timed run), the runs of a seed in
rotated order. Colocated (engine and trainer share every core: today's loop):

  sync_fp32      rollout.async_depth=0, clean view
  async_k1       async_depth=1, exact mode
  async_k2       async_depth=2, exact mode
  sync_fp8       async_depth=0, weights=fp8 view
  async_k1_fp8   async_depth=1, exact mode, weights=fp8 view

Disaggregated (rollout.placement=disaggregated: the JAX engine in a process of its own on half of the
cores, the trainer on the rest, opdjax.rollout.jax.sidecar), the baseline async is built for (run after
every colocated run, in a session of their own: the engine's process pins the trainer's threads):

  sync_disaggregated, async_k1_disaggregated, async_k2_disaggregated (exact),
  async_k1_bounded_disaggregated, sync_fp8_disaggregated, async_k1_fp8_disaggregated

On CPU the process gets two host devices (JAX_NUM_CPU_DEVICES=2): colocated, the trainer trains on
device 0 and the asynchronous producer samples on device 1 (XLA's threads of both on every core). Held-out evaluation
(every --eval-every steps) pauses the producer and its seconds are left out of the wall clock, the
same way for every configuration; the clock includes everything else (sampling, weight sync, the
train step, host work).

Writes OUT/time_to_quality.json: per run the curve (step, train wall seconds, held-out accuracy and
reverse KL), seconds to the accuracy target and to the reverse-KL target, wall seconds at equal
steps, final quality, process CPU seconds per wall second, the median time split of asynchronous
runs; per configuration medians over seeds and whether its final quality is within the seed
tolerance of sync_fp32 (the calibration's rule: max(tolerance_sigmas * std * sqrt(2 / seeds),
tolerance_rel * |median|)); and `speedup_async_k1` = median over seeds of sync_fp32 seconds-to-target
/ async_k1 seconds-to-target (accuracy target), the same for the other configurations;
`speedup_async_k1_vs_sync_disaggregated` (sync_disaggregated / async_k1_disaggregated),
`speedup_async_k1_vs_sync_colocated` (sync_fp32 / async_k1_disaggregated) and
`overlap_efficiency_async_k1` (median over async_k1_disaggregated's steps and seeds). Plus
OUT/time_to_quality.png: quality vs wall clock, one curve per configuration (median over seeds).

  python scripts/time_to_quality.py --out runs/ttq [--seeds 3] [--steps 800] [--eval-every 20]
      [--config configs/demo_worked.py] [--teacher-scoring engine]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")  # before JAX starts: a host device a side

import numpy as np  # noqa: E402

CONFIGS = {  # name: (rollout view, async depth, async mode, rollout.placement)
    "sync_fp32": ("clean", 0, "exact", "colocated"),
    "async_k1": ("clean", 1, "exact", "colocated"),
    "async_k2": ("clean", 2, "exact", "colocated"),
    "sync_fp8": ("weights=fp8", 0, "exact", "colocated"),
    "async_k1_fp8": ("weights=fp8", 1, "exact", "colocated"),
    "sync_disaggregated": ("clean", 0, "exact", "disaggregated"),
    "async_k1_disaggregated": ("clean", 1, "exact", "disaggregated"),
    "async_k2_disaggregated": ("clean", 2, "exact", "disaggregated"),
    "async_k1_bounded_disaggregated": ("clean", 1, "bounded", "disaggregated"),
    "sync_fp8_disaggregated": ("weights=fp8", 0, "exact", "disaggregated"),
    "async_k1_fp8_disaggregated": ("weights=fp8", 1, "exact", "disaggregated"),
}
DEFAULT = ("sync_fp32", "sync_disaggregated", "async_k1_disaggregated", "async_k2_disaggregated",
           "async_k1_bounded_disaggregated", "sync_fp8_disaggregated", "async_k1_fp8_disaggregated")
SPLIT = ("time_generate_s", "time_weight_sync_s", "time_prepare_s", "time_queue_wait_s", "time_producer_wait_s",
         "time_train_s", "idle_trainer_frac", "idle_producer_frac", "overlap_efficiency", "busy_producer_frac",
         "busy_trainer_frac", "overlap_speedup_bound")


def children_cpu_s() -> float:
  """CPU seconds of this process's running children (a disaggregated engine's process)."""
  tick, total, me = os.sysconf("SC_CLK_TCK"), 0.0, os.getpid()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if int(fields[1]) == me:
      total += (int(fields[11]) + int(fields[12])) / tick
  return total


class Curve:
  """Held-out quality against the wall clock with evaluation left out (a loop hook)."""

  def __init__(self):
    self.points = []

  def start(self, loop):
    self.cpu0, self.children0 = time.process_time(), children_cpu_s()

  def record(self, loop, rec):
    if rec.get("eval_step") == rec["step"] or rec["step"] == 0:  # later records repeat the last evaluation
      wall = time.time() - loop.t0 - loop.eval_s
      self.points.append({"step": rec["step"], "wall_s": round(wall, 3), "accuracy": rec["accuracy"],
                          "reverse_kl": rec["reverse_kl"]})

  def end(self, loop):
    self.cpu_s = time.process_time() - self.cpu0
    self.children_cpu_s = children_cpu_s() - self.children0

  def __getattr__(self, name):  # the other Hook methods: nothing to do
    if name in ("ready", "after_step", "phase", "close"):
      return lambda *a: None
    raise AttributeError(name)


def first_reaching(points, key, target, better):
  for p in points:
    if better(p[key], target):
      return p["wall_s"]
  return None


def run_one(sessions, name, seed, steps, eval_every, targets):
  from opdjax.pipeline.hooks import EvalHook
  from opdjax.pipeline.loop import run_loop
  from opdjax.views.view import EngineView

  spec, depth, mode, placement = CONFIGS[name]
  session = sessions[placement]
  curve = Curve()
  load0 = os.getloadavg()[0]
  w0 = time.time()
  loop = run_loop(session, view=EngineView.parse(spec), seed=seed, steps=steps,
                  hooks=[EvalHook(eval_every, pause=True), curve], async_depth=depth, async_mode=mode)
  wall_total = time.time() - w0
  recs, pts = loop.records, curve.points
  final = recs[-1]
  out = {
      "config": name, "seed": seed, "view": spec, "async_depth": depth, "async_mode": mode, "placement": placement,
      "curve": pts,
      "seconds_to_accuracy": first_reaching(pts, "accuracy", targets["accuracy"], lambda v, t: v >= t),
      "seconds_to_reverse_kl": first_reaching(pts, "reverse_kl", targets["reverse_kl"], lambda v, t: v <= t),
      "wall_s_at_equal_steps": pts[-1]["wall_s"], "steps": steps,
      "final_accuracy": final["accuracy"], "final_reverse_kl": final["reverse_kl"],
      "eval_s": round(loop.eval_s, 3), "process_cpu_per_wall": round(curve.cpu_s / max(wall_total, 1e-9), 3),
      "engine_process_cpu_per_wall": round(curve.children_cpu_s / max(wall_total, 1e-9), 3),
      "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
      "trainer_cpus": sorted(os.sched_getaffinity(0)),  # this thread's cores at the end (pinned when disaggregated)
  }
  timed = [r for r in recs[1:] if "time_train_s" in r]
  if timed:
    out["time_split_median"] = {k: float(np.median([r[k] for r in timed])) for k in SPLIT if k in timed[0]}
    out["params_lag_mean"] = float(np.mean([r["params_lag"] for r in recs[1:]]))
    out["overlap_efficiency_steps"] = [r["overlap_efficiency"] for r in timed[2:] if "overlap_efficiency" in r]
  return out


def summarize(runs, seeds, cfg):
  by = {name: [r for r in runs if r["config"] == name] for name in CONFIGS}
  by = {k: v for k, v in by.items() if v}
  c = cfg.calibrate
  out = {"configs": {}}
  base = by.get("sync_fp32")
  for name, rs in by.items():
    s = {"view": rs[0]["view"], "async_depth": rs[0]["async_depth"]}
    for key in ("seconds_to_accuracy", "seconds_to_reverse_kl", "wall_s_at_equal_steps", "final_accuracy",
                "final_reverse_kl"):
      vals = [r[key] for r in rs]
      s[key] = None if any(v is None for v in vals) else float(np.median(vals))
      s[key + "_seeds"] = vals
    if base:
      s["seconds_per_step_ratio_vs_sync_fp32"] = (
          float(np.median([b["wall_s_at_equal_steps"] / r["wall_s_at_equal_steps"] for b, r in zip(base, rs)])))
      s["quality_within_tolerance_of_sync_fp32"] = {}
      for m, sign in (("final_accuracy", -1), ("final_reverse_kl", +1)):
        ref = [b[m] for b in base]
        tol = max(c.tolerance_sigmas * float(np.std(ref, ddof=1)) * np.sqrt(2.0 / len(ref)) if len(ref) > 1 else 0.0,
                  c.tolerance_rel * abs(float(np.median(ref))))
        loss = sign * (float(np.median([r[m] for r in rs])) - float(np.median(ref)))
        s["quality_within_tolerance_of_sync_fp32"][m] = {"loss": loss, "tolerance": tol, "within": bool(loss <= tol)}
    out["configs"][name] = s

  def speedup(a, b, key="seconds_to_accuracy"):
    """Median over seeds of a's seconds-to-target / b's. A run that never reached the target counts
    with its whole wall clock, a bound on its time to target, and the ratio is then a bound: `bound`
    says which way ('>=' when only a missed it, '<=' when only b did; None: every ratio exact)."""
    if a not in by or b not in by:
      return None
    ratios, kinds = [], set()
    for x, y in zip(by[a], by[b]):
      if x[key] is None and y[key] is None:
        continue
      ratios.append((x[key] or x["wall_s_at_equal_steps"]) / (y[key] or y["wall_s_at_equal_steps"]))
      kinds.add(">=" if x[key] is None else "<=" if y[key] is None else "=")
    if not ratios:
      return None
    kinds.discard("=")
    return {"median": float(np.median(ratios)), "seeds": ratios, "bound": "/".join(sorted(kinds)) or None}

  pairs = {"async_k1": ("sync_fp32", "async_k1"), "async_k2": ("sync_fp32", "async_k2"),
           "sync_fp8": ("sync_fp32", "sync_fp8"), "async_k1_fp8": ("sync_fp32", "async_k1_fp8"),
           "async_k1_fp8_vs_sync_fp8": ("sync_fp8", "async_k1_fp8"),
           "async_k1_vs_sync_disaggregated": ("sync_disaggregated", "async_k1_disaggregated"),
           "async_k1_vs_sync_colocated": ("sync_fp32", "async_k1_disaggregated"),
           "async_k2_vs_sync_disaggregated": ("sync_disaggregated", "async_k2_disaggregated"),
           "async_k1_bounded_vs_sync_disaggregated": ("sync_disaggregated", "async_k1_bounded_disaggregated"),
           "async_k1_fp8_vs_sync_fp8_disaggregated": ("sync_fp8_disaggregated", "async_k1_fp8_disaggregated"),
           "sync_disaggregated_vs_sync_colocated": ("sync_fp32", "sync_disaggregated")}
  for name, (a, b) in pairs.items():
    s = speedup(a, b)
    out[f"speedup_{name}"] = None if s is None else s["median"]
    out[f"speedup_{name}_detail"] = s
    out[f"speedup_{name}_reverse_kl"] = speedup(a, b, "seconds_to_reverse_kl")
    if a in by and b in by:  # throughput alone: wall seconds at equal steps
      out[f"steps_speedup_{name}"] = float(np.median([x["wall_s_at_equal_steps"] / y["wall_s_at_equal_steps"]
                                                      for x, y in zip(by[a], by[b])]))
  effs = [e for r in by.get("async_k1_disaggregated", []) for e in r.get("overlap_efficiency_steps", [])]
  out["overlap_efficiency_async_k1"] = float(np.median(effs)) if effs else None
  out["reached_accuracy_target"] = {n: sum(r["seconds_to_accuracy"] is not None for r in rs) for n, rs in by.items()}
  return out


def plot(runs, path):
  from opdjax.analyses import reporting

  fig, axes = reporting.figure(1, 2, figsize=(11, 4))
  names = list(dict.fromkeys(r["config"] for r in runs))
  for i, name in enumerate(names):
    rs = [r for r in runs if r["config"] == name]
    n = min(len(r["curve"]) for r in rs)
    wall = np.median([[p["wall_s"] for p in r["curve"][:n]] for r in rs], axis=0)
    for ax, key in zip(axes, ("accuracy", "reverse_kl")):
      ax.plot(wall, np.median([[p[key] for p in r["curve"][:n]] for r in rs], axis=0), color=f"C{i}", label=name)
  for ax, key in zip(axes, ("accuracy", "reverse_kl")):
    ax.set_xlabel("wall clock, held-out evaluation left out (s)")
    ax.set_ylabel(f"held-out {key} (median of seeds)")
    if key == "reverse_kl":
      ax.set_yscale("log")
    ax.legend(fontsize=8)
  return reporting.save_figure(fig, path)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--config", default="configs/demo.py")
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--steps", type=int, default=0, help="default: the config's train.steps")
  p.add_argument("--eval-every", type=int, default=20)
  p.add_argument("--target-accuracy", type=float, default=0.95)
  p.add_argument("--target-reverse-kl", type=float, default=0.1)
  p.add_argument("--configs", default=",".join(DEFAULT), help=f"of {', '.join(CONFIGS)}")
  p.add_argument("--warmup-steps", type=int, default=4)
  p.add_argument("--teacher-scoring", choices=("trainer", "engine"), default="trainer",
                 help="rollout.teacher_scoring of the disaggregated configurations (engine: the teacher's layers"
                      " run in the engine's process; colocated ones always score on the trainer)")
  args = p.parse_args(argv)

  from opdjax.analyses import reporting
  from opdjax.config.resolve import resolve_config
  from opdjax.pipeline.session import Session

  names = [n.strip() for n in args.configs.split(",")]
  unknown = [n for n in names if n not in CONFIGS]
  if unknown:
    p.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
  cfg = resolve_config(args.config, {})
  steps = args.steps or cfg.train.steps
  targets = {"accuracy": args.target_accuracy, "reverse_kl": args.target_reverse_kl}
  runs = []
  # One placement at a time, colocated first: a disaggregated engine's process pins this process's
  # threads to the trainer's cores while it lives (opdjax.rollout.cores), which a colocated run must not
  # inherit. Within a placement, every function is compiled (warm-up runs) before any timed run.
  for placement in ("colocated", "disaggregated"):
    group = [n for n in names if CONFIGS[n][3] == placement]
    if not group:
      continue
    scoring = args.teacher_scoring if placement == "disaggregated" else "trainer"
    sessions = {placement: Session(cfg.replace(rollout={"placement": placement, "teacher_scoring": scoring}), None,
                                   progress=False)}
    try:
      for name in group:
        run_one(sessions, name, cfg.seed, args.warmup_steps, args.eval_every, targets)
      for s in range(args.seeds):
        order = group[s % len(group):] + group[:s % len(group)]  # load drifts: no configuration always first
        for name in order:
          r = run_one(sessions, name, cfg.seed + s, steps, args.eval_every, targets)
          runs.append(r)
          print(f"{name} seed {cfg.seed + s}: to accuracy {args.target_accuracy}: {r['seconds_to_accuracy']} s,"
                f" {steps} steps {r['wall_s_at_equal_steps']:.1f} s, final accuracy {r['final_accuracy']:.3f},"
                f" cpu/wall {r['process_cpu_per_wall']} (+ engine process {r['engine_process_cpu_per_wall']}),"
                f" trainer cores {r['trainer_cpus']}, load {r['loadavg_1min']}", file=sys.stderr, flush=True)
    finally:
      sessions[placement].close()
  result = {"targets": targets, "steps": steps, "seeds": args.seeds, "eval_every": args.eval_every,
            "teacher_scoring_disaggregated": args.teacher_scoring,
            "config": args.config, "cpu_count": os.cpu_count(), "runs": runs, **summarize(runs, args.seeds, cfg)}
  os.makedirs(args.out, exist_ok=True)
  reporting.write_json(os.path.join(args.out, "time_to_quality.json"), result)
  plot(runs, os.path.join(args.out, "time_to_quality.png"))
  print(f"speedup_async_k1_vs_sync_disaggregated {result['speedup_async_k1_vs_sync_disaggregated']};"
        f" speedup_async_k1_vs_sync_colocated {result['speedup_async_k1_vs_sync_colocated']};"
        f" overlap_efficiency_async_k1 {result['overlap_efficiency_async_k1']};"
        f" wrote {args.out}/time_to_quality.json and .png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
