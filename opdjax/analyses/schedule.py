"""`opdjax plan --schedule`: the steady-state step time of sync colocated, sync disaggregated and
async k (exact, bounded) from per-stage costs, and the rollout/training device split minimising it.

Stages of a step (seconds): the producer's `generate` g, `prepare` p (the objective's inputs) and
`load` l (installing a params version), the trainer's `train` t and `export` x (publishing the
params: copy, export, transfer), and h, the trainer thread's host time outside every timed stage
(the loop's records and hooks; measured as the wall clock's step minus the split's, 0 when
modelled), counted in t below. The algebra (the loop of opdjax.pipeline: exact mode's data
dependency, bounded mode's admission rule; `simulate` runs it event by event):

  sync (either placement)   step = g + p + l + t + x        each side waits while the other works
  async k >= 1, exact       step = max(g + p + l, t + x)    rollout t needs version t - k: the
                                                            producer runs up to k steps ahead
  async k >= 1, bounded     the same period; the lag is k behind a fast producer, less behind a slow one

Colocated and disaggregated differ in the costs, not the algebra: colocated, each stage has every
device (and the engine's copy is a local copy); disaggregated, g, p, l run on the rollout devices,
t, x on the trainer's, and x moves the weights over the link between them.

Costs come from either
- measured records (`--measure RUN ...`: metrics.jsonl of timed or asynchronous runs, whose time
  split opdjax.pipeline.loop.Timing writes; medians after the first steps; a config file given
  there is run here, `--steps` steps synchronously timed and with async_depth=k, on one Session
  that compiled both first), each run's costs also predicting the measured step of a run of the
  other kind given with it (a consistency check on the runs given, the same placement assumed; the
  validation on measured layouts, each predicted from other runs' costs only, is
  scripts/validate_schedule.py, rendered in docs/async.md), or
- a model of the layout's accelerators (opdjax.analyses.schedule_model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

from opdjax.errors import UserError
from opdjax.pipeline import overlap


@dataclasses.dataclass(frozen=True)
class Costs:
  """Seconds a step of each stage (see the module doc)."""

  generate: float
  train: float
  prepare: float = 0.0
  load: float = 0.0
  export: float = 0.0
  host: float = 0.0  # the trainer thread's time outside every timed stage (the loop's records, hooks, dispatch)

  @property
  def producer(self) -> float:
    return self.generate + self.prepare + self.load

  @property
  def trainer(self) -> float:
    return self.train + self.export + self.host


def sync_step(c: Costs) -> float:
  return c.producer + c.trainer


def async_step(c: Costs, k: int = 1) -> float:
  """Steady state of either mode, k >= 1: the larger side (see `simulate` for the derivation)."""
  if k < 1:
    return sync_step(c)
  return max(c.producer, c.trainer)


def simulate(c: Costs, k: int, mode: str = "exact", steps: int = 64) -> dict:
  """The loop's schedule event by event: the trainer publishes version s (`export`), waits for rollout
  s, trains; the producer starts rollout r once rollout r - 1 is done, version r - k is published and
  the queue has room (rollout r - k taken), with version r - k (exact) or the newest published
  (bounded). Returns the steady-state period (median of the second half's steps) and mean lag."""
  publish, take, end, ready, lags = [], [], [], [], []
  t_end = 0.0
  for s in range(steps):
    publish.append(t_end + c.export)
    r = s  # the producer's rollout s, from what is known once version s is published
    need = max(r - k, 0)
    start = max(ready[r - 1] if r else 0.0, publish[need], take[r - k] if r - k >= 0 else 0.0)
    version = need if mode == "exact" else max(v for v, p in enumerate(publish) if p <= start)
    ready.append(start + c.producer)
    lags.append(s - version)
    take.append(max(publish[s], ready[s]))
    t_end = take[s] + c.train + c.host
    end.append(t_end)
  periods = [b - a for a, b in zip(end[steps // 2:], end[steps // 2 + 1:])]
  return {"step_s": statistics.median(periods), "lag_mean": statistics.fmean(lags[steps // 2:])}


# --- measured costs ------------------------------------------------------------------------------

def read_records(path: str) -> list[dict]:
  file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise UserError(f"--measure {path!r}: no metrics.jsonl there; give a run folder (opdjax train --out) or its"
                    " metrics.jsonl, of a timed or asynchronous run.")
  with open(file) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  if not any("time_train_s" in r for r in recs):
    raise UserError(f"{file} has no time split (time_train_s): it is a synchronous run without timing; run it with"
                    " rollout.async_depth > 0, or timed (run_loop(..., timed=True)).")
  return recs


def measured_costs(records: list[dict], skip: int = 2) -> tuple[Costs, dict]:
  """Costs from a run's time split (medians after `skip` timed steps), and what the run measured:
  its depth, its step time (median of the wall clock's steps) and its overlap fields."""
  timed = [r for r in records if "time_train_s" in r][skip:]
  if not timed:
    raise UserError(f"the run has {len(records)} records, none timed after the first {skip}: run more steps.")
  med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
  depth = int(timed[0].get("async_depth", 0))
  if depth:  # the trainer's export is in time_train_s (publish, less its wait for the step); the producer loaded
    costs = Costs(generate=med("time_generate_s"), prepare=med("time_prepare_s"),
                  load=statistics.median(overlap.generate_side(r) - r.get("time_generate_s", 0.0)
                                         - r.get("time_prepare_s", 0.0) for r in timed),
                  train=med("time_train_s") - med("time_publish_s") + med("time_publish_wait_s"),
                  export=med("time_publish_s") - med("time_publish_wait_s"))
  else:  # one thread: export and load are one weight sync, between the two sides
    costs = Costs(generate=med("time_generate_s"), prepare=med("time_prepare_s"), load=med("time_weight_sync_s"),
                  train=med("time_train_s"))
  # The step: the wall clock's slope over the timed steps (wall_s has 1 ms resolution: a median of
  # differences would be quantized to whole milliseconds).
  walls = [r["wall_s"] for r in records if "wall_s" in r][skip:]
  summary = overlap.summary(records, skip)
  step = (walls[-1] - walls[0]) / (len(walls) - 1) if len(walls) > 1 else summary.get("step_s")
  # What the time split does not hold: the wall clock's step over the step the split accounts for
  # (the trainer's work plus its wait), the loop's own host time on the trainer's thread.
  accounted = statistics.median(overlap.split(r)[2] for r in timed)
  costs = dataclasses.replace(costs, host=max(step - accounted, 0.0) if step is not None else 0.0)
  return costs, {"async_depth": depth, "steps": len(timed), "step_s": step,
                 "overlap_efficiency": summary.get("overlap_efficiency")}


def measure_config(path: str, steps: int, k: int) -> list[tuple[str, list[dict]]]:
  """Records of `steps` steps of config `path`, synchronous (timed) and asynchronous (depth k), on one
  Session that ran a few steps of both first (compiles left out)."""
  from opdjax.config.resolve import resolve_config
  from opdjax.pipeline.loop import run_loop
  from opdjax.pipeline.session import Session
  from opdjax.rollout.deploy import _host_devices

  _host_devices()  # on CPU a host device for the producer, as `opdjax train` gives it
  session = Session(resolve_config(path, {}), None, progress=False)
  try:
    run_loop(session, steps=3, timed=True)
    run_loop(session, steps=3, async_depth=k)
    sync = run_loop(session, steps=steps, timed=True).records
    asynchronous = run_loop(session, steps=steps, async_depth=k).records
  finally:
    session.close()
  return [(f"{path} (sync)", sync), (f"{path} (async k={k})", asynchronous)]


def predict_measured(paths: list[str], k: int = 1, fp8_generate_speedup: float = 1.0, steps: int = 30,
                     fp8_source: str = "") -> dict:
  """Predictions from each run's measured costs (their own placement) and, where a run of the other
  kind is given too, its measured step beside the prediction. A config file (.py) is run here.
  `fp8_generate_speedup` divides the measured generate cost: an input (a CPU cannot measure FP8's
  speed; its `fp8_source` says where the number comes from), never a prediction."""
  if fp8_generate_speedup != 1.0 and not fp8_source.strip():
    raise UserError(f"--fp8-generate-speedup {fp8_generate_speedup}: an input, not something the planner measures;"
                    " give its source with --fp8-source TEXT (e.g. a GPU benchmark of the FP8 engine).")
  if fp8_generate_speedup <= 0:
    raise UserError(f"--fp8-generate-speedup {fp8_generate_speedup}: give a factor > 0 (1: no FP8).")
  sources, runs = [], []
  for path in paths:
    sources += measure_config(path, steps, k) if path.endswith(".py") else [(path, read_records(path))]
  for path, records in sources:
    costs, measured = measured_costs(records)
    if fp8_generate_speedup != 1.0:
      costs = dataclasses.replace(costs, generate=costs.generate / fp8_generate_speedup)
    runs.append({"path": path, "costs": dataclasses.asdict(costs), "measured": measured,
                 "predicted": {"sync_s": sync_step(costs), f"async_k{k}_s": async_step(costs, k),
                               "async_bounded_lag_mean": simulate(costs, k, "bounded")["lag_mean"],
                               "speedup_async_over_sync": sync_step(costs) / async_step(costs, k),
                               "overlap_speedup_bound": overlap.speedup_bound(costs.producer, costs.trainer)}})
    own = async_step(costs, k) if measured["async_depth"] else sync_step(costs)  # its own kind: the algebra alone
    runs[-1]["predicted"]["own_step_error"] = own / measured["step_s"] - 1 if measured["step_s"] else None
  out = {"mode": "measured", "k": k, "runs": runs, "checks": [],
         "inputs": ({"fp8_generate_speedup": {"value": fp8_generate_speedup, "source": fp8_source.strip()}}
                    if fp8_generate_speedup != 1.0 else {})}
  # Each run's costs predict the other kind's step (the same placement assumed): a consistency check
  # on the runs given; scripts/validate_schedule.py is the validation on measured layouts.
  for a in runs:
    for b in runs:
      if a is b or bool(a["measured"]["async_depth"]) == bool(b["measured"]["async_depth"]):
        continue
      key = f"async_k{k}_s" if b["measured"]["async_depth"] else "sync_s"
      pred, meas = a["predicted"][key], b["measured"]["step_s"]
      out["checks"].append({"costs_of": a["path"], "predicts": b["path"], "predicted_s": pred, "measured_s": meas,
                            "error": pred / meas - 1})
  return out


# --- report --------------------------------------------------------------------------------------

def _ms(x: float) -> str:
  return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def report(result: dict) -> str:
  k = result["k"]
  if result["mode"] == "measured":
    lines = [f"opdjax plan --schedule (measured costs; async k={k}, predicted steady state)"]
    fp8 = result.get("inputs", {}).get("fp8_generate_speedup")
    if fp8:
      lines.append(f"  input, not measured or predicted: FP8 generation x{fp8['value']:g} faster (each run's generate"
                   f" cost divided by it); source: {fp8['source']}")
    for run in result["runs"]:
      c, m, p = run["costs"], run["measured"], run["predicted"]
      kind = f"async k={m['async_depth']}" if m["async_depth"] else "sync (timed)"
      lines += [f"  {run['path']} ({kind}, {m['steps']} timed steps)",
                "    costs: " + ", ".join(f"{n} {_ms(v)}" for n, v in c.items()),
                f"    predicted: sync {_ms(p['sync_s'])}, async k={k} {_ms(p[f'async_k{k}_s'])} (x"
                f"{p['speedup_async_over_sync']:.2f}; perfect overlap bound x{p['overlap_speedup_bound']:.2f}),"
                f" bounded lag {p['async_bounded_lag_mean']:.2f}",
                f"    measured: step {_ms(m['step_s'])}" + (f", overlap efficiency {m['overlap_efficiency']:.2f}"
                                                            if m["overlap_efficiency"] is not None else "")
                + (f"; its own kind predicted {100 * p['own_step_error']:+.0f}%" if p["own_step_error"] is not None
                   else "")]
    for c in result["checks"]:
      lines.append(f"  {c['costs_of']}'s costs predict {c['predicts']}: {_ms(c['predicted_s'])} a step, measured"
                   f" {_ms(c['measured_s'])} ({100 * c['error']:+.0f}%)")
    return "\n".join(lines)
  lay, ba, bs = result["layout"], result["best_async"], result["best_sync_disaggregated"]
  lines = [f"opdjax plan --schedule (modelled, predicted): {lay['devices']} x {lay['device']}, batch {lay['batch']} x"
           f" {lay['seq_len']} (prompt {lay['prompt_len']}){', FP8 engine' if lay['fp8'] else ''}; async k={k}",
           f"  efficiency {lay['efficiency']}; device: {lay['source']}",
           *([f"  input, not a prediction: {result['inputs']['fp8']['text']}"] if lay["fp8"] else []), "",
           f"  {'rollout/trainer':<17}{'generate':>11}{'train':>11}{'sync':>10}{'sync disagg':>13}"
           f"{f'async k={k}':>11}"]
  for s in result["splits"]:
    c = s["costs"]
    lines.append(f"  {s['rollout_devices']:>2} / {s['trainer_devices']:<12}{_ms(c['generate']):>11}"
                 f"{_ms(c['train']):>11}{_ms(c['load']):>10}{_ms(s['sync_disaggregated_s']):>13}"
                 f"{_ms(s[f'async_k{k}_s']):>11}")
  lines.append("")
  if "sync_colocated_s" in result:
    lines.append(f"  sync colocated (every device both sides): {_ms(result['sync_colocated_s'])} a step")
  else:
    lines.append(f"  sync colocated: does not fit ({result['sync_colocated_error']})")
  lines += [f"  best sync disaggregated: {bs['rollout_devices']} rollout / {bs['trainer_devices']} trainer,"
            f" {_ms(bs['sync_disaggregated_s'])} a step",
            f"  best async k={k}: {ba['rollout_devices']} rollout / {ba['trainer_devices']} trainer,"
            f" {_ms(ba[f'async_k{k}_s'])} a step (bounded mode's mean lag {ba['bounded_lag_mean']:.2f})",
            f"  predicted speedup of async: x{result['speedup_async_vs_sync_disaggregated']:.2f} vs sync"
            f" disaggregated (each at its best split; x{result['speedup_async_vs_sync_disaggregated_same_split']:.2f}"
            " at the async split)" + (f", x{result['speedup_async_vs_sync_colocated']:.2f} vs sync colocated"
                                      if "speedup_async_vs_sync_colocated" in result else "")]
  return "\n".join(lines)
