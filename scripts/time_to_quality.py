"""Time to quality: does overlapping sampling with training reach the target sooner than the best synchronous layout?

Runs the demo (configs/demo.py) in the `--configs` configurations, `--seeds` seeds each, on one Session
a layout (placement and teacher scoring; every function compiled once, warmed up before any timed run),
the runs of a seed in rotated order. The default set is each synchronous layout a user would run and
async k=1 (exact) in each:

  sync_fp32, async_k1                  colocated (engine and trainer share every core), teacher on the trainer
  sync_disaggregated, async_k1_disaggregated
                                       the JAX engine in a process of its own on half of the cores
                                       (opdjax.rollout.jax.sidecar), the trainer on the rest, teacher on
                                       the trainer (or --teacher-scoring engine)
  sync_disaggregated_teacher_engine, async_k1_disaggregated_teacher_engine
                                       the same, the teacher's layers in the engine's process
                                       (rollout.teacher_scoring=engine, which needs that process: a
                                       colocated run always scores on the trainer)

and on request async_k2, sync_fp8, async_k1_fp8 (colocated), async_k2_disaggregated,
async_k1_bounded_disaggregated, sync_fp8_disaggregated, async_k1_fp8_disaggregated.

On CPU the process gets two host devices (JAX_NUM_CPU_DEVICES=2): colocated, the trainer trains on
device 0 and the asynchronous producer samples on device 1 (XLA's threads of both on every core).
Held-out evaluation (every --eval-every steps, on --num-eval prompts) pauses the producer; its seconds
are left out of the wall clock and its CPU seconds out of each side's, the same way for every
configuration; the clock includes everything else (sampling, weight sync, the train step, host work).
Per layout and seed a timed synchronous run (--timed-steps, no evaluation) gives the trainer's step
time that an asynchronous run's is compared with.

Writes OUT/time_to_quality.json. The headline, `speedup_async_k1_vs_best_sync`: per seed, the fastest
synchronous configuration's seconds to the reverse-KL target (fastest by median over seeds; `against`)
over the fastest async k=1 configuration's (`async`), with the median, spread, and the physical bound:
what any overlap could gain over that synchronous run, from the CPU seconds each side used (its work
over the machine's cores, and each pinned side's over its own). The reverse-KL target is given or
`auto`: halfway, in log space, from the start to the largest final reverse KL of any run, on the
curves' steep part and crossed by every run; seconds to a target interpolate between evaluations.
Each run samples the 1-minute load at each evaluation and the CPU the rest of the machine used while
it ran; a run over --max-load or --max-other-cpu is flagged and left out of the headline. Per run:
the curve (step, wall_s, accuracy, reverse_kl, load_1min), seconds to each target, wall seconds at
equal steps, final quality, each side's CPU seconds, the median time split and the schedule's
per-stage costs (asynchronous runs; the timed synchronous runs in `timed_syncs`). Per configuration:
medians over seeds, quality within the seed tolerance of sync_fp32 (the calibration's rule), and for
an asynchronous one `trainer_step_ratio_vs_sync` (its trainer's step over the synchronous run's of the
same layout: overlap efficiency's companion, which shows a slowed trainer). Pair ratios
`speedup_<a>_vs_<b>` (to the accuracy target; `_reverse_kl` to the other; `steps_speedup_` at equal
steps), and OUT/time_to_quality.png: quality vs wall clock, one curve per configuration.

  python scripts/time_to_quality.py --out runs/ttq [--seeds 5] [--steps 1200] [--eval-every 40]
      [--num-eval 1024] [--config configs/demo_worked.py] [--teacher-scoring engine] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")  # before JAX starts: a host device a side

import numpy as np  # noqa: E402

CONFIGS = {  # name: (rollout view, async depth, async mode, rollout.placement, teacher scoring)
    # teacher scoring None: --teacher-scoring for a disaggregated one, the trainer for a colocated one
    # (rollout.teacher_scoring=engine needs the engine's own process)
    "sync_fp32": ("clean", 0, "exact", "colocated", "trainer"),
    "async_k1": ("clean", 1, "exact", "colocated", "trainer"),
    "async_k2": ("clean", 2, "exact", "colocated", "trainer"),
    "sync_fp8": ("weights=fp8", 0, "exact", "colocated", "trainer"),
    "async_k1_fp8": ("weights=fp8", 1, "exact", "colocated", "trainer"),
    "sync_disaggregated": ("clean", 0, "exact", "disaggregated", None),
    "async_k1_disaggregated": ("clean", 1, "exact", "disaggregated", None),
    "async_k2_disaggregated": ("clean", 2, "exact", "disaggregated", None),
    "async_k1_bounded_disaggregated": ("clean", 1, "bounded", "disaggregated", None),
    "sync_fp8_disaggregated": ("weights=fp8", 0, "exact", "disaggregated", None),
    "async_k1_fp8_disaggregated": ("weights=fp8", 1, "exact", "disaggregated", None),
    "sync_disaggregated_teacher_engine": ("clean", 0, "exact", "disaggregated", "engine"),
    "async_k1_disaggregated_teacher_engine": ("clean", 1, "exact", "disaggregated", "engine"),
}
# The headline's set: each synchronous layout a user would run and async k=1 in each, the teacher on
# the trainer's side (where both layouts allow it) and on the engine's (where only disaggregated does).
DEFAULT = ("sync_fp32", "async_k1", "sync_disaggregated", "async_k1_disaggregated",
           "sync_disaggregated_teacher_engine", "async_k1_disaggregated_teacher_engine")
SPLIT = ("time_generate_s", "time_weight_sync_s", "time_load_s", "time_prepare_s", "time_queue_wait_s",
         "time_producer_wait_s", "time_publish_s", "time_publish_wait_s", "time_train_s", "idle_trainer_frac",
         "idle_producer_frac", "overlap_efficiency", "busy_producer_frac", "busy_trainer_frac", "overlap_speedup_bound")
QUICK = {"steps": 30, "seeds": 2, "eval_every": 10, "num_eval": 64, "warmup_steps": 2, "timed_steps": 8}


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


def machine_busy_s() -> float:
  """CPU seconds every process on the machine has used (user, nice, system, irq, softirq, steal)."""
  with open("/proc/stat") as f:
    v = [int(x) for x in f.readline().split()[1:]]
  return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def cpu_now() -> tuple[float, float]:
  return time.process_time(), children_cpu_s()


def timed_eval(every: int):
  """An EvalHook (the producer paused) that also counts the evaluation's CPU seconds, both processes."""
  from opdjax.pipeline.hooks import EvalHook

  class TimedEval(EvalHook):
    cpu = (0.0, 0.0)

    def _timed(self, f, *args):
      c0 = cpu_now()
      f(*args)
      self.cpu = tuple(a + n - b for a, n, b in zip(self.cpu, cpu_now(), c0))

    def ready(self, loop):
      self._timed(super().ready, loop)

    def after_step(self, loop, step):
      self._timed(super().after_step, loop, step)

  return TimedEval(every, pause=True)


class Curve:
  """Held-out quality against the wall clock with evaluation left out, the 1-minute load at each
  evaluation, and the CPU seconds of the run's two sides (this process, the engine's process), the
  evaluation's (`evals`, a timed_eval) left out too: a loop hook."""

  def __init__(self, evals):
    self.points, self.evals = [], evals

  def start(self, loop):
    self.cpu0, self.busy0, self.wall0 = cpu_now(), machine_busy_s(), time.time()

  def record(self, loop, rec):
    if rec.get("eval_step") == rec["step"] or rec["step"] == 0:  # later records repeat the last evaluation
      wall = time.time() - loop.t0 - loop.eval_s
      self.points.append({"step": rec["step"], "wall_s": round(wall, 3), "accuracy": rec["accuracy"],
                          "reverse_kl": rec["reverse_kl"], "load_1min": round(os.getloadavg()[0], 2)})

  def end(self, loop):
    c1, wall = cpu_now(), time.time() - self.wall0
    self.cpu_s = [c1[i] - self.cpu0[i] - self.evals.cpu[i] for i in range(2)]  # trainer side, engine process
    own = sum(c1[i] - self.cpu0[i] for i in range(2))
    self.other_cpu_per_wall = (machine_busy_s() - self.busy0 - own) / max(wall, 1e-9)

  def __getattr__(self, name):  # the other Hook methods: nothing to do
    if name in ("ready", "after_step", "phase", "close"):
      return lambda *a: None
    raise AttributeError(name)


def first_reaching(points, key, target, better):
  """Wall seconds at which the curve first reaches `target`, linear between the two evaluations
  around the crossing (reverse KL in log space); None if it never does."""
  f = (lambda v: np.log(max(v, 1e-12))) if key == "reverse_kl" else (lambda v: v)
  for prev, p in zip([None, *points], points):
    if better(p[key], target):
      if prev is None or f(p[key]) == f(prev[key]):
        return p["wall_s"]
      x = (f(target) - f(prev[key])) / (f(p[key]) - f(prev[key]))
      return round(prev["wall_s"] + x * (p["wall_s"] - prev["wall_s"]), 4)
  return None


def run_one(sessions, name, seed, steps, eval_every, scoring):
  from opdjax.pipeline.loop import run_loop
  from opdjax.views.view import EngineView

  spec, depth, mode, placement, _ = CONFIGS[name]
  session = sessions[(placement, scoring)]
  evals = timed_eval(eval_every)
  curve = Curve(evals)
  load0 = os.getloadavg()[0]
  w0 = time.time()
  loop = run_loop(session, view=EngineView.parse(spec), seed=seed, steps=steps, hooks=[evals, curve],
                  async_depth=depth, async_mode=mode)
  wall_total = time.time() - w0
  recs, pts = loop.records, curve.points
  final = recs[-1]
  wall = pts[-1]["wall_s"]
  loads = [p["load_1min"] for p in pts]
  out = {
      "config": name, "seed": seed, "view": spec, "async_depth": depth, "async_mode": mode, "placement": placement,
      "teacher_scoring": scoring, "curve": pts, "wall_s_at_equal_steps": wall, "steps": steps,
      "final_accuracy": final["accuracy"], "final_reverse_kl": final["reverse_kl"],
      "eval_s": round(loop.eval_s, 3), "process_cpu_per_wall": round(curve.cpu_s[0] / max(wall, 1e-9), 3),
      "engine_process_cpu_per_wall": round(curve.cpu_s[1] / max(wall, 1e-9), 3),
      # CPU seconds of each side, held-out evaluation left out (this process; the engine's process)
      "cpu_s": {"trainer_process": round(curve.cpu_s[0], 3), "engine_process": round(curve.cpu_s[1], 3)},
      "other_cpu_per_wall": round(curve.other_cpu_per_wall, 3),  # the rest of the machine, while this ran
      "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
      "load_1min_median": float(np.median(loads)), "load_1min_max": max(loads),
      "wall_s_total": round(wall_total, 3),
      "trainer_cpus": sorted(os.sched_getaffinity(0)),  # this thread's cores at the end (pinned when disaggregated)
  }
  timed = [r for r in recs[1:] if "time_train_s" in r]
  if timed:
    out.update(time_split(recs))
    out["params_lag_mean"] = float(np.mean([r["params_lag"] for r in recs[1:]]))
    out["overlap_efficiency_steps"] = [r["overlap_efficiency"] for r in timed[2:] if "overlap_efficiency" in r]
  return out


def time_split(recs) -> dict:
  """The median time split of timed records and the schedule's per-stage costs (ms)."""
  from opdjax.analyses.schedule import measured_costs

  timed = [r for r in recs[1:] if "time_train_s" in r]
  out = {"time_split_median": {k: float(np.median([r.get(k, 0.0) for r in timed])) for k in SPLIT
                               if any(k in r for r in timed)}}
  if len(timed) <= 2:  # a warm-up: the schedule's costs skip the first two timed steps
    return out
  costs, measured = measured_costs(recs)
  out["costs_ms"] = {k: round(1e3 * v, 3) for k, v in dataclasses.asdict(costs).items()}
  out["step_ms"] = None if measured["step_s"] is None else round(1e3 * measured["step_s"], 3)
  return out


def timed_sync(sessions, key, seed, steps) -> dict:
  """A synchronous run with its time split (the Clock blocks after each stage): the trainer's step
  time an asynchronous run's is compared with. Not a quality run."""
  from opdjax.pipeline.loop import run_loop

  loop = run_loop(sessions[key], seed=seed, steps=steps, timed=True)
  return {"placement": key[0], "teacher_scoring": key[1], "seed": seed, "steps": steps, **time_split(loop.records)}


def flag(run, max_load, max_other_cpu) -> list[str]:
  """Why a run was measured beside other work (excluded from the headline), or []."""
  why = []
  if run["load_1min_median"] > max_load:
    why.append(f"1-minute load {run['load_1min_median']} (median over its evaluations) > {max_load}")
  if run["other_cpu_per_wall"] > max_other_cpu:
    why.append(f"other processes used {run['other_cpu_per_wall']} CPU s / wall s > {max_other_cpu}")
  return why


def summarize(runs, timed_syncs, cfg, headline_key="seconds_to_reverse_kl"):
  by = {name: [r for r in runs if r["config"] == name] for name in CONFIGS}
  by = {k: v for k, v in by.items() if v}
  c = cfg.calibrate
  out = {"configs": {}}
  base = by.get("sync_fp32")
  trainer_step = {(t["placement"], t["teacher_scoring"]): t["time_split_median"]["time_train_s"]
                  for t in timed_syncs}
  for name, rs in by.items():
    s = {"view": rs[0]["view"], "async_depth": rs[0]["async_depth"], "placement": rs[0]["placement"],
         "teacher_scoring": rs[0]["teacher_scoring"]}
    for key in ("seconds_to_accuracy", "seconds_to_reverse_kl", "wall_s_at_equal_steps", "final_accuracy",
                "final_reverse_kl"):
      vals = [r[key] for r in rs]
      s[key] = None if any(v is None for v in vals) else float(np.median(vals))
      s[key + "_seeds"] = vals
    sync_train = trainer_step.get((rs[0]["placement"], rs[0]["teacher_scoring"]))
    if rs[0]["async_depth"] and sync_train and "time_split_median" in rs[0]:
      # Overlap efficiency's companion, which can fall: the trainer's step in this run against its
      # step in a synchronous run of the same layout (a slowed trainer shows as > 1).
      s["trainer_step_ratio_vs_sync"] = float(np.median([r["time_split_median"]["time_train_s"] / sync_train
                                                         for r in rs]))
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
           "sync_disaggregated_vs_sync_colocated": ("sync_fp32", "sync_disaggregated"),
           # overlap alone, the teacher on the engine's side; moving the teacher alone, sync and async
           "async_k1_vs_sync_disaggregated_teacher_engine": ("sync_disaggregated_teacher_engine",
                                                             "async_k1_disaggregated_teacher_engine"),
           "sync_teacher_engine_vs_sync_teacher_trainer_disaggregated": ("sync_disaggregated",
                                                                         "sync_disaggregated_teacher_engine"),
           "async_k1_teacher_engine_vs_async_k1_teacher_trainer_disaggregated": (
               "async_k1_disaggregated", "async_k1_disaggregated_teacher_engine"),
           "sync_disaggregated_teacher_engine_vs_sync_colocated": ("sync_fp32", "sync_disaggregated_teacher_engine")}
  for name, (a, b) in pairs.items():
    s = speedup(a, b)
    out[f"speedup_{name}"] = None if s is None else s["median"]
    out[f"speedup_{name}_detail"] = s
    out[f"speedup_{name}_reverse_kl"] = speedup(a, b, "seconds_to_reverse_kl")
    if a in by and b in by:  # throughput alone: wall seconds at equal steps
      out[f"steps_speedup_{name}"] = float(np.median([x["wall_s_at_equal_steps"] / y["wall_s_at_equal_steps"]
                                                      for x, y in zip(by[a], by[b])]))
  for name in ("async_k1", "async_k1_disaggregated", "async_k1_disaggregated_teacher_engine"):
    effs = [e for r in by.get(name, []) for e in r.get("overlap_efficiency_steps", [])]
    out[f"overlap_efficiency_{name}"] = float(np.median(effs)) if effs else None
  out["overlap_efficiency_async_k1"] = out["overlap_efficiency_async_k1_disaggregated"]  # the name it had
  out["reached_accuracy_target"] = {n: sum(r["seconds_to_accuracy"] is not None for r in rs) for n, rs in by.items()}
  out["reached_reverse_kl_target"] = {n: sum(r["seconds_to_reverse_kl"] is not None for r in rs)
                                      for n, rs in by.items()}
  out["speedup_async_k1_vs_best_sync"] = headline(by, headline_key)
  # The same with the flagged runs in: what a loaded box measured, never the headline.
  out["speedup_async_k1_vs_best_sync_all_runs"] = headline(by, headline_key, include_flagged=True)
  return out


def physical_bound(run, cores: int) -> dict:
  """What overlap can gain at most over synchronous `run`, from the CPU seconds each side used: the
  same work can take no less than its CPU seconds over the machine's cores, nor less than each
  pinned side's CPU seconds over its own cores (a disaggregated layout: one core a side here)."""
  t, e = run["cpu_s"]["trainer_process"], run["cpu_s"]["engine_process"]
  wall = run["wall_s_at_equal_steps"]
  floor = (t + e) / cores
  if run["placement"] == "disaggregated":
    n_t = len(run["trainer_cpus"])
    floor = max(floor, t / n_t, e / max(cores - n_t, 1))
  return {"cpu_s_trainer_process": t, "cpu_s_engine_process": e, "wall_s": wall,
          "bound": round(wall / max(floor, 1e-9), 4)}


def headline(by, key, cores: int | None = None, include_flagged: bool = False):
  """Async k=1 (the fastest of its layouts, by median seconds to target) against the fastest
  synchronous configuration (clean view, any layout or teacher scoring), per seed, flagged runs
  (measured beside other work) left out of both unless `include_flagged`."""
  if include_flagged:
    by = {n: [{**r, "flagged": False} for r in rs] for n, rs in by.items()}

  def t(r):
    return r[key] if r[key] is not None else r["wall_s_at_equal_steps"]  # a miss counts with its whole run

  def fastest(names):
    meds = {n: float(np.median([t(r) for r in by[n] if not r.get("flagged")])) for n in names
            if any(not r.get("flagged") for r in by[n])}
    return (min(meds, key=meds.get) if meds else None), meds

  syncs = [n for n in by if CONFIGS[n][1] == 0 and CONFIGS[n][0] == "clean"]
  asyncs = [n for n in by if CONFIGS[n][1:3] == (1, "exact") and CONFIGS[n][0] == "clean"]
  best_sync, sync_meds = fastest(syncs)
  best_async, async_meds = fastest(asyncs)
  if best_sync is None or best_async is None:
    return None
  seeds, ratios, bounds, excluded, kinds = [], [], [], [], set()
  for x, y in zip(by[best_sync], by[best_async]):
    if x.get("flagged") or y.get("flagged"):
      excluded.append(x["seed"])
      continue
    seeds.append(x["seed"])
    ratios.append(t(x) / t(y))
    kinds.add(">=" if x[key] is None else "<=" if y[key] is None else "=")
    bounds.append(physical_bound(x, cores or os.cpu_count()))
  if not ratios:
    return {"median": None, "against": best_sync, "async": best_async, "excluded_seeds": excluded}
  kinds.discard("=")
  return {"median": float(np.median(ratios)), "seeds": seeds, "per_seed": ratios,
          "min": float(min(ratios)), "max": float(max(ratios)), "target": key,
          "bound": "/".join(sorted(kinds)) or None, "against": best_sync, "async": best_async,
          "sync_medians_s": sync_meds, "async_medians_s": async_meds, "excluded_seeds": excluded,
          "physical_bound": float(np.median([b["bound"] for b in bounds])), "physical_bound_seeds": bounds,
          "steps_ratio": float(np.median([x["wall_s_at_equal_steps"] / y["wall_s_at_equal_steps"]
                                          for x, y in zip(by[best_sync], by[best_async])
                                          if not (x.get("flagged") or y.get("flagged"))]))}


def auto_reverse_kl_target(runs) -> float:
  """Halfway, in log space, between the step-0 reverse KL (median of runs) and the largest final one:
  on the curves' steep part, and crossed by every run (each ends at or below the largest final)."""
  start = float(np.median([r["curve"][0]["reverse_kl"] for r in runs]))
  end = max(r["final_reverse_kl"] for r in runs)
  if start <= end:  # some run ends where the runs started (too few steps to learn): no steep part
    return float(start)
  return float(np.exp(0.5 * (np.log(start) + np.log(end))))


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
  p.add_argument("--seeds", type=int, default=5)
  p.add_argument("--steps", type=int, default=0, help="default: the config's train.steps")
  p.add_argument("--eval-every", type=int, default=40)
  p.add_argument("--num-eval", type=int, default=1024, help="held-out prompts (task.num_eval)")
  p.add_argument("--target-accuracy", type=float, default=0.95)
  p.add_argument("--target-reverse-kl", default="auto",
                 help="a number, or auto: halfway in log space from the start to the largest final reverse KL")
  p.add_argument("--configs", default=",".join(DEFAULT), help=f"of {', '.join(CONFIGS)}")
  p.add_argument("--warmup-steps", type=int, default=4)
  p.add_argument("--timed-steps", type=int, default=100,
                 help="steps of the timed synchronous run per layout and seed (the trainer's step time)")
  p.add_argument("--teacher-scoring", choices=("trainer", "engine"), default="trainer",
                 help="rollout.teacher_scoring of the disaggregated configurations without one of their own")
  p.add_argument("--max-load", type=float, default=1.5 * os.cpu_count(),
                 help="a run whose median 1-minute load exceeds this is flagged, left out of the headline")
  p.add_argument("--max-other-cpu", type=float, default=0.25,
                 help="a run beside other processes using more CPU s / wall s than this is flagged")
  p.add_argument("--quick", action="store_true", help=f"a check of the script in about a minute: {QUICK}")
  args = p.parse_args(argv)
  if args.quick:
    for k, v in QUICK.items():
      setattr(args, k, v)

  from opdjax.analyses import reporting
  from opdjax.config.resolve import resolve_config
  from opdjax.pipeline.session import Session

  names = [n.strip() for n in args.configs.split(",")]
  unknown = [n for n in names if n not in CONFIGS]
  if unknown:
    p.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
  cfg = resolve_config(args.config, {})
  cfg = cfg.replace(task={"num_eval": args.num_eval})
  steps = args.steps or cfg.train.steps
  scoring = {n: CONFIGS[n][4] or (args.teacher_scoring if CONFIGS[n][3] == "disaggregated" else "trainer")
             for n in names}
  runs, timed_syncs, load_start = [], [], os.getloadavg()[0]
  t_start = time.time()
  # One layout at a time, colocated first: a disaggregated engine's process pins this process's
  # threads to the trainer's cores while it lives (opdjax.rollout.cores), which a colocated run must not
  # inherit. Within a layout, every function is compiled (warm-up runs) before any timed run.
  for key in sorted({(CONFIGS[n][3], scoring[n]) for n in names}, key=lambda k: (k[0] != "colocated", k)):
    group = [n for n in names if (CONFIGS[n][3], scoring[n]) == key]
    sessions = {key: Session(cfg.replace(rollout={"placement": key[0], "teacher_scoring": key[1]}), None,
                             progress=False)}
    try:
      for name in group:
        run_one(sessions, name, cfg.seed, args.warmup_steps, args.eval_every, key[1])
      timed_sync(sessions, key, cfg.seed, args.warmup_steps + 2)  # the timed path's compiles
      for s in range(args.seeds):
        order = group[s % len(group):] + group[:s % len(group)]  # load drifts: no configuration always first
        if args.timed_steps:
          timed_syncs.append(timed_sync(sessions, key, cfg.seed + s, args.timed_steps))
        for name in order:
          r = run_one(sessions, name, cfg.seed + s, steps, args.eval_every, key[1])
          runs.append(r)
          print(f"{name} seed {cfg.seed + s}: {steps} steps {r['wall_s_at_equal_steps']:.1f} s, final accuracy"
                f" {r['final_accuracy']:.3f}, reverse KL {r['final_reverse_kl']:.4f}, cpu/wall"
                f" {r['process_cpu_per_wall']} (+ engine process {r['engine_process_cpu_per_wall']}), other"
                f" processes {r['other_cpu_per_wall']}, trainer cores {r['trainer_cpus']}, load {r['loadavg_1min']}",
                file=sys.stderr, flush=True)
    finally:
      sessions[key].close()
  # The targets, once every curve is in: accuracy as given, reverse KL as given or on the steep part.
  rkl = auto_reverse_kl_target(runs) if args.target_reverse_kl == "auto" else float(args.target_reverse_kl)
  targets = {"accuracy": args.target_accuracy, "reverse_kl": rkl, "reverse_kl_rule": args.target_reverse_kl}
  for r in runs:
    start = r["curve"][0]["reverse_kl"]
    r["reverse_kl_target_crossed"] = start > rkl and r["final_reverse_kl"] <= rkl  # from above, within the run
    r["seconds_to_accuracy"] = first_reaching(r["curve"], "accuracy", targets["accuracy"], lambda v, t: v >= t)
    r["seconds_to_reverse_kl"] = first_reaching(r["curve"], "reverse_kl", rkl, lambda v, t: v <= t)
    r["flag"] = flag(r, args.max_load, args.max_other_cpu)
    r["flagged"] = bool(r["flag"])
  targets["reverse_kl_crossed_by_every_run"] = all(r["reverse_kl_target_crossed"] for r in runs)
  result = {"targets": targets, "headline_target": "reverse_kl", "steps": steps, "seeds": args.seeds,
            "eval_every": args.eval_every, "num_eval": args.num_eval,
            "teacher_scoring_disaggregated": args.teacher_scoring, "config": args.config,
            "cpu_count": os.cpu_count(), "max_load": args.max_load, "max_other_cpu": args.max_other_cpu,
            "load_1min_start": round(load_start, 2), "wall_s_total": round(time.time() - t_start, 1),
            "flagged_runs": [f"{r['config']} seed {r['seed']}: {'; '.join(r['flag'])}" for r in runs if r["flagged"]],
            "timed_syncs": timed_syncs, "runs": runs, **summarize(runs, timed_syncs, cfg)}
  os.makedirs(args.out, exist_ok=True)
  reporting.write_json(os.path.join(args.out, "time_to_quality.json"), result)
  plot(runs, os.path.join(args.out, "time_to_quality.png"))
  import importlib.util

  spec = importlib.util.spec_from_file_location("ttq_report", os.path.join(os.path.dirname(__file__), "ttq_report.py"))
  ttq_report = importlib.util.module_from_spec(spec)  # scripts/: the renderers the docs use too
  spec.loader.exec_module(ttq_report)

  if (result["speedup_async_k1_vs_best_sync"] or {}).get("median") is not None:
    print(ttq_report.summary(result), ttq_report.table(result), sep="\n\n")
  print(f"flagged runs {len(result['flagged_runs'])}; {result['wall_s_total']:.0f} s; wrote"
        f" {args.out}/time_to_quality.json and .png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
