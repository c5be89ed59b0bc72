"""`opdjax calibrate --bracket`: after the configured views, what the calibration runs next until the
budget is bracketed, as a pure function of the points so far (`next_step`), and the two sides it
ends with (`sides`).

A view *passes* when its quality loss (opdjax.analyses.verdicts.view_loss: seed medians against the
clean runs') is within the tolerance on every metric, *clearly fails* when the loss's Welch 95%
interval lies above the tolerance on some metric (the verdict's two notions, claim 1), and
*straddles* when it fails on its median but its interval reaches down to the tolerance: more seeds
may make it a clear failure. Each step, in this order:
  0. clean seeds: the clean view, which every view's loss is measured against, is topped up to the most
     seeds any view has (a view's median against 3 clean seeds compares its 6 draws with 3: on the
     addition task's sampled objective, 2026-12-06, the clean view's 3 seeds spread 0.008 in accuracy and
     noise_sigma=0.1's 6 seeds 0.019, so the tolerance came from the luckier, narrower sample);
  1. seeds: the straddling view of smallest mismatch below the smallest clear failure (or below
     every view when none failed clearly) gets twice its seeds, at most `max_seeds`: more seeds
     narrow its interval until it falls on one side;
  2. stop "bracketed" when a view clearly fails (and no straddler below it can still be refined);
  3. view: the next rung of the noise ladder, `factor` x the largest noise sigma tried (0.1 when
     none was), with the calibration's seeds, unless it would pass `ceiling` (stop "ceiling": the
     budget is then a lower bound up to the largest mismatch tried) or the run budget `max_runs`
     (0: none) cannot pay for it (stop "run budget").
The noise ladder is the one family extended: its mismatch grows smoothly with sigma and needs no
longer params history (a lag ladder is bounded by calibrate.warmup_steps, a format ladder by the
formats the engine has).
"""

from __future__ import annotations

import dataclasses
import math

from opdjax.analyses.verdicts import view_loss
from opdjax.views.view import EngineView

FIRST_SIGMA = 0.1  # the first rung when the configured views hold no noise view


@dataclasses.dataclass(frozen=True)
class Step:
  kind: str            # "seeds" (more seeds for `view`), "view" (a new view) or "stop"
  view: str = ""       # the view to run
  seeds: int = 0       # the seed count that view should reach
  reason: str = ""     # why (for "stop": bracketed, ceiling or run budget, and what was found)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _noise_sigma(view: str) -> float:
  return 0.0 if view == "clean" else EngineView.parse(view).noise_sigma


def classify(points: list[dict], fit: dict) -> list[dict]:
  """Each non-clean point, by mismatch: {view, mismatch, seeds, loss (per metric: loss, low, high),
  pass, clear_fail, straddles}."""
  metrics, tol = fit["metrics"], fit["tolerance"]
  clean = next(p for p in points if p["view"] == "clean")
  rows = []
  for p in sorted((p for p in points if p["view"] != "clean"), key=lambda p: p["mismatch"]):
    loss = view_loss(p, clean, metrics)
    clear = any(loss[m][1] > tol[m] for m in metrics)
    passes = all(loss[m][0] <= tol[m] for m in metrics)
    rows.append({"view": p["view"], "mismatch": p["mismatch"], "seeds": len(p[metrics[0]]), "loss": loss,
                 "pass": passes, "clear_fail": clear, "straddles": not clear and not passes})
  return rows


def runs_used(points: list[dict], fit: dict) -> int:
  return sum(len(p[fit["metrics"][0]]) for p in points)


def next_step(points: list[dict], fit: dict, seeds: int, max_seeds: int, factor: float, ceiling: float,
              max_runs: int = 0) -> Step:
  """The calibration's next step (the module doc's rule). `seeds`: a new view's seed count;
  `max_runs`: training runs the whole calibration may spend (0: no limit)."""
  rows = classify(points, fit)
  used = runs_used(points, fit)
  affordable = (lambda n: True) if max_runs <= 0 else (lambda n: used + n <= max_runs)
  clean = len(next(p for p in points if p["view"] == "clean")[fit["metrics"][0]])
  most = max([r["seeds"] for r in rows], default=0)
  if most > clean and affordable(most - clean):
    return Step("seeds", "clean", most, f"a view has {most} seeds and the clean runs it is measured against {clean}")
  fails = [r for r in rows if r["clear_fail"]]
  edge = fails[0]["mismatch"] if fails else math.inf
  for r in rows:
    if r["straddles"] and r["mismatch"] < edge and r["seeds"] < max_seeds:
      want = min(2 * r["seeds"], max_seeds)
      if affordable(want - r["seeds"]):
        return Step("seeds", r["view"], want, f"its interval straddles the tolerance at {r['seeds']} seeds")
  if fails:
    return Step("stop", reason=f"bracketed: {fails[0]['view']} fails clearly at mismatch {edge:.4g}")
  top = max(_noise_sigma(p["view"]) for p in points)
  sigma = float(f"{factor * top:.3g}") if top > 0 else FIRST_SIGMA
  if sigma > ceiling:
    return Step("stop", reason=f"ceiling: the next rung noise_sigma={sigma:.3g} is past the ceiling {ceiling:g}")
  if not affordable(seeds):
    return Step("stop", reason=f"run budget: {used} of {max_runs} runs spent, a new view needs {seeds}")
  return Step("view", str(EngineView(noise_sigma=sigma)), seeds, "no view failed clearly")


def sides(points: list[dict], fit: dict, stop: Step, ceiling: float) -> dict:
  """Both sides of the bracket for budget.json: `high` the smallest clearly failing view (None: none),
  `low` the largest passing view below it (None: none), `largest_tried` and the `statement` the
  report prints ("between LOW and HIGH", or "lower bound up to X" with X the largest mismatch tried)."""
  rows = classify(points, fit)
  fails = [r for r in rows if r["clear_fail"]]
  high = fails[0] if fails else None
  edge = high["mismatch"] if high else math.inf
  below = [r for r in rows if r["pass"] and r["mismatch"] < edge]
  low = max(below, key=lambda r: r["mismatch"]) if below else None
  top = max(rows, key=lambda r: r["mismatch"]) if rows else None

  def side(r):
    return None if r is None else {"view": r["view"], "mismatch": r["mismatch"], "seeds": r["seeds"],
                                   "loss": {m: list(v) for m, v in r["loss"].items()}}

  lo_text = f"{low['view']} ({low['mismatch']:.4g})" if low else "no passing view"
  status = stop.reason.split(":")[0]
  stopped = f"ceiling noise_sigma={ceiling:g}" if status == "ceiling" else stop.reason
  if high:
    statement = f"between {lo_text} and {high['view']} ({high['mismatch']:.4g})"
  else:
    statement = f"lower bound up to {top['mismatch']:.4g} ({top['view']}; {stopped})" if top else "no view beyond clean"
  return {"status": status, "reason": stop.reason, "low": side(low), "high": side(high),
          "largest_tried": side(top), "ceiling": {"noise_sigma": ceiling}, "statement": statement,
          "straddling": [r["view"] for r in rows if r["straddles"]]}
