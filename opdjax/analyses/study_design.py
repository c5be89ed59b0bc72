"""scripts/reproduce.py's design choices that give its verdicts power (opdjax.analyses.verdicts):
how many seeds each calibration view gets (from the clean runs' spread) and which admission
candidates straddle the budget. Pure functions of the calibration's points. (Which views extend the
calibration until one fails is `calibrate.bracket`'s rule: opdjax.analyses.bracket.)"""

from __future__ import annotations

import numpy as np

from opdjax.analyses import verdicts

# The objective claims 1 and 5 are decided on (docs/reproduction.md, "The objective"): sampled_rkl with the
# trainer's log-probs, where the engine's samples are the tokens the signal scores (verl, slime), so mismatch
# changes what the student is taught, not only where. Chosen, before the run that decides the verdict, from
# bench/sampled_pilot.py (addition, 400 steps, clean, seeds 0-2, 2026-12-06, load 4-14 on 2 cores; start:
# held-out reverse KL 8.17, accuracy 0.016): at the demo's lr 5e-3 with no baseline it did not learn (9.03,
# 9.01, 10.11); with the leave-one-out baseline lr 2e-3 gave 7.44, 7.62, 7.01, lr 1e-3 gave 7.26, 7.41, 7.18
# (accuracy 0.047-0.063) and lr 5e-4 7.47-7.54; the exact student half with loo was unstable (lr 2e-3: 7.25,
# 8.80, 7.52; lr 5e-3: 7.77, 9.29, 9.15). lr 1e-3 with loo: the largest gain and the smallest spread.
SAMPLED_STUDY = {"loss.kind": "sampled_rkl", "loss.baseline": "loo", "loss.student_term": "sampled",
                 "loss.student_logprobs": "trainer", "optim.learning_rate": 1e-3}
# Reported beside it, each with its own bracket, so that no form is picked after the fact: the engine's
# log-probs in the advantage (the tinker form), and full_rkl (the engine picks only prefixes) at the demo's lr.
FORMS = {
    "engine_logprobs": {"form": "sampled_rkl, advantage from the engine's log-probs (tinker)",
                        "overrides": {"loss.student_logprobs": "rollout"}},
    "full_rkl": {"form": "full_rkl: exact KL on the trainer's logits; the engine picks only prefixes",
                 "overrides": {"loss.kind": "full_rkl", "loss.baseline": "none", "optim.learning_rate": 5e-3}},
}


def form_of(loss) -> str:
  """One name of the objective form a run trained (recorded with each calibration)."""
  if loss.kind != "sampled_rkl":
    return loss.kind
  return (f"sampled_rkl (student log-probs: {loss.student_logprobs}, baseline {loss.baseline},"
          f" student term {loss.student_term})")


def _sigma(view: str) -> float:
  from opdjax.views.view import EngineView  # here: scripts/reproduce.py's constants above load without jax

  return EngineView.parse(view).noise_sigma


def seeds_for_power(clean: dict, start: dict, tolerance_sigmas: float, pilot: int, max_seeds: int,
                    tolerance_rel: float = 0.0) -> dict:
  """`admission.calibrate`'s `power`: the seeds each view needs for claim 1's power rule, from the
  clean runs so far. Per metric, `verdicts.seeds_needed(s_clean, gain, k)`: the smallest n with
  k * s_clean * sqrt(2/n) <= gain / 2 (s_clean the clean seeds' std, gain the clean median's
  improvement over the starting student); the most any learning metric needs, at least `pilot`, at
  most `max_seeds` (the run budget's share of one view). A metric that did not learn needs nothing
  (claim 1 is inconclusive on it whatever the seeds). `floor_limits`: the metrics whose floor
  (`tolerance_rel` x |clean median|) alone exceeds half the gain: seeds cannot give those power,
  longer runs or a lower floor can."""
  needed, floor_limits = {}, []
  for m in verdicts.QUALITY:
    if clean.get(m):
      gain = verdicts.clean_gain(clean, start, m)
      needed[m] = verdicts.seeds_needed(float(np.std(clean[m], ddof=1)), gain, tolerance_sigmas)
      if gain > 0 and tolerance_rel * abs(float(np.median(clean[m]))) > gain / 2:
        floor_limits.append(m)
  want = max([n for n in needed.values() if n is not None], default=pilot)
  return {"seeds": int(min(max(want, pilot), max(max_seeds, pilot))), "needed": needed, "max_seeds": max_seeds,
          "clean_std": {m: float(np.std(clean[m], ddof=1)) for m in needed}, "floor_limits": floor_limits}


def candidates(recipe_weights: str, warmup_steps: int, budget: dict) -> str:
  """>= 6 candidate lines (`NAME: VIEW`): the sensitivity recipe (with and without FP8 KV), the FP8
  e5m2 preset, a stale lag within the protocol's history, and three noise levels placed from the
  calibration to straddle the budget: below the largest passing noise view, between it and the
  smallest failing one (clearly failing where one is), and beyond that one (the candidate meant to
  degrade in training; with no failing view, 2x and 3x the largest noise tried, which nothing says
  will degrade)."""
  fit = budget["fit"]
  clean = next(p for p in budget["points"] if p["view"] == "clean")
  noise = [(_sigma(p["view"]), p) for p in budget["points"] if p["family"] == "noise"]
  passing = [s for s, p in noise if p["pass"] and p["mismatch"] <= budget["budget"]] or [0.05]
  # The failing side from the clearly failing noise views (quality-loss interval above the tolerance:
  # the ones known to degrade), else from those whose median fails.
  clear = [s for s, p in noise
           if any(lo > fit["tolerance"][m] for m, (_, lo, _) in verdicts.view_loss(p, clean, fit["metrics"]).items())]
  failing = clear or [s for s, p in noise if not p["pass"]]
  lo, hi = max(passing), (min(failing) if failing else 2 * max([s for s, _ in noise] or [0.1]))
  sigmas = {"below": 0.7 * lo, "between": float(np.sqrt(lo * hi)), "beyond": 1.5 * hi}
  lag = max(1, warmup_steps // 2)
  lines = [f"fp8-recipe: weights={recipe_weights}", f"fp8-recipe-kv8: weights={recipe_weights},kv_quant=fp8_e4m3",
           "fp8-e5m2: weights=fp8_e5m2", f"lag{lag}: lag={lag}"]
  lines += [f"noise-{k}-{v:.3g}: noise_sigma={v:.3g}" for k, v in sigmas.items()]
  return "\n".join(lines) + "\n"
