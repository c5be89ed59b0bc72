"""opdjax.analyses.verdicts: each rule driven to each of its outcomes from synthetic stage results."""

import json
import math

import numpy as np
import pytest

from opdjax.analyses import verdicts as V

CLEAN = [1.00, 1.02, 0.98]  # reverse KL of three clean seeds; the start is 3.0: OPD learned 2.0


def fit_for(points, sigmas=3.0, rel=0.0):
  clean = next(p for p in points if p["view"] == "clean")
  s = float(np.std(clean["reverse_kl"], ddof=1))
  n = len(clean["reverse_kl"])
  floor = rel * abs(np.median(clean["reverse_kl"]))
  tol = max(sigmas * s * math.sqrt(2 / n), floor)
  losses = {p["view"]: np.median(p["reverse_kl"]) - np.median(clean["reverse_kl"]) for p in points}
  failing = [p["mismatch"] for p in points if losses[p["view"]] > tol]
  edge = min(failing) if failing else math.inf
  passing = [p["mismatch"] for p in points if losses[p["view"]] <= tol and p["mismatch"] < edge]
  return {"metrics": ["reverse_kl"], "tolerance": {"reverse_kl": tol}, "clean_std": {"reverse_kl": s},
          "tolerance_sigmas": sigmas, "tolerance_floor": {"reverse_kl": floor}, "seeds": n, "budget": max(passing)}


def point(view, mismatch, centre, spread=0.02):
  return {"view": view, "mismatch": mismatch, "reverse_kl": [centre - spread, centre, centre + spread]}


def bracket(points, start=3.0, **kw):
  points = [{"view": "clean", "mismatch": 0.0, "reverse_kl": CLEAN}, *points]
  return V.budget_bracket(points, fit_for(points, **kw), {"reverse_kl": start}, {"used": 9, "budget": 12})


def test_interval_and_welch_match_the_t_formula():
  m, lo, hi = V.interval([1.0, 2.0, 3.0])
  assert m == 2.0 and hi - m == pytest.approx(4.3027 * 1.0 / math.sqrt(3), rel=1e-4)  # t_{0.975, 2}
  assert V.interval([5.0])[1:] == (-math.inf, math.inf)
  assert V.welch_half_width([1, 1, 1], [2, 2, 2]) == 0.0
  assert V.welch_half_width([1.0], [2.0, 3.0]) == math.inf
  # Seeds needed: k * s * sqrt(2/n) <= gain / 2 -> n >= 2 (2 k s / gain)^2.
  assert V.seeds_needed(0.1, 1.0, 3.0) == 2 and V.seeds_needed(0.5, 1.0, 3.0) == math.ceil(2 * 3.0 ** 2) == 18
  assert V.seeds_needed(1.0, 1.0, 3.0) == 72 and V.seeds_needed(0.1, 0.0, 3.0) is None


def test_claim1_holds_when_bracketed():
  v = bracket([point("noise0.1", 0.1, 1.01), point("noise0.4", 0.4, 1.5), point("noise0.8", 0.8, 2.5)])
  assert v.outcome == "holds", v.reason
  assert v.evidence["largest_pass_below"]["view"] == "noise0.1"
  assert v.evidence["smallest_clear_fail"]["view"] == "noise0.4"
  json.dumps(v.to_dict())  # plain JSON


def test_claim1_without_a_clear_failure_is_a_lower_bound():
  # noise0.4 fails on its median but its interval reaches below the tolerance: not a clear failure.
  tol = 3 * 0.02 * math.sqrt(2 / 3)
  wide = {"view": "noise0.4", "mismatch": 0.4, "reverse_kl": [0.9, 1.0 + 2 * tol, 1.6]}
  v = bracket([point("noise0.1", 0.1, 1.01), wide])
  assert v.outcome == "inconclusive" and v.label == "inconclusive (lower bound only)", v.reason
  assert not v.evidence["views"][1]["pass"] and not v.evidence["views"][1]["clear_fail"]
  assert bracket([point("noise0.1", 0.1, 1.01)]).label == "inconclusive (lower bound only)"


def test_claim1_does_not_hold_when_a_view_passes_above_a_clear_failure():
  v = bracket([point("noise0.1", 0.1, 1.01), point("fp8", 0.3, 2.0), point("noise0.8", 0.8, 1.0)])
  assert v.outcome == "does not hold" and "noise0.8" in v.reason, v.reason


def test_claim1_inconclusive_without_learning_or_power_or_a_pass_below():
  assert "did not improve" in bracket([point("a", 0.1, 1.0), point("b", 1.0, 3.0)], start=1.01).reason
  # A tolerance floor (rel 0.6 of the clean 1.0) above half the 2.0 gain: underpowered.
  v = bracket([point("a", 0.1, 1.0), point("b", 1.0, 3.0)], rel=1.2)
  assert v.outcome == "inconclusive" and v.label == "inconclusive (underpowered)" and "underpowered" in v.reason
  points = [{"view": "clean", "mismatch": 0.0, "reverse_kl": CLEAN}, point("b", 1.0, 3.0)]
  v = V.budget_bracket(points, fit_for(points, rel=1.2), {"reverse_kl": 3.0}, {"used": 6, "budget": 6, "max_seeds": 3})
  assert "the run budget of 6 runs buys 3 a view" in v.reason, v.reason
  v = bracket([point("a", 0.1, 2.0), point("b", 1.0, 3.0)])
  assert v.outcome == "inconclusive" and v.label == "inconclusive (upper bound only)"


def test_claim1_inconclusive_when_the_fitted_budget_is_not_between_the_bracketing_views():
  # fp8 fails on its median (not clearly) below noise0.5, which passes: the fit's budget stops below fp8 (at
  # noise0.1), while the verdict's bracket is noise0.5 (pass) .. noise0.8 (clear failure).
  tol = 3 * 0.02 * math.sqrt(2 / 3)
  wobbly = {"view": "fp8", "mismatch": 0.3, "reverse_kl": [0.9, 1.0 + 2 * tol, 1.6]}
  v = bracket([point("noise0.1", 0.1, 1.01), wobbly, point("noise0.5", 0.5, 1.0), point("noise0.8", 0.8, 2.5)])
  assert v.outcome == "inconclusive" and v.label == "inconclusive (budget not between)", v.reason
  assert v.evidence["budget"] == 0.1 and v.evidence["largest_pass_below"]["view"] == "noise0.5"
  assert "not between" in v.reason


def test_claim1_tolerance_takes_n_from_the_clean_seeds_run_not_the_pilots_count():
  # The pilot ran 3 clean seeds (the fit's `seeds`), the bracket topped the clean view up to 6. With k = 3 and the
  # clean std s, k*s*sqrt(2/3) is 0.044 and k*s*sqrt(2/6) 0.031: a loss of 0.04 passes only under n = 3.
  clean6 = [0.98, 1.0, 1.02, 0.98, 1.0, 1.02]
  s = float(np.std(clean6, ddof=1))
  points = [{"view": "clean", "mismatch": 0.0, "reverse_kl": clean6},
            {"view": "a", "mismatch": 0.1, "reverse_kl": [1.035, 1.04, 1.045]}]
  fit = {"metrics": ["reverse_kl"], "clean_std": {"reverse_kl": s}, "tolerance_sigmas": 3.0,
         "tolerance_floor": {"reverse_kl": 0.0}, "seeds": 3, "budget": 0.0}
  v = V.budget_bracket(points, fit, {"reverse_kl": 3.0}, {"used": 9, "budget": 12})
  assert v.evidence["clean_seeds"] == 6
  assert v.evidence["tolerance"]["reverse_kl"] == pytest.approx(3 * s * math.sqrt(2 / 6))
  assert 3 * s * math.sqrt(2 / 6) < 0.04 < 3 * s * math.sqrt(2 / 3)  # the setting separates the two rules
  assert not v.evidence["views"][0]["pass"]
  # The one rule, shared by the calibration's fit and the re-derivation from a result file's evidence.
  from opdjax.analyses import admission, rederive
  cal = admission.fit_budget([dict(p) for p in points], 3, 3.0, 0.0)
  assert cal["clean_seeds"] == 6 and cal["tolerance"] == v.evidence["tolerance"]
  stored = json.loads(json.dumps(v.to_dict()))
  assert rederive.derive("1", {"evidence": stored["evidence"]}, {}).label == v.label
  assert V.tolerance(0.02, 2, 3.0, 0.5) == (0.5, "floor") and V.tolerance(0.02, 2, 3.0, 0.0)[1] == "clean spread"


def test_claim1_says_which_side_set_the_tolerance():
  points = [{"view": "clean", "mismatch": 0.0, "reverse_kl": CLEAN}, point("b", 1.0, 3.0)]
  v = V.budget_bracket(points, fit_for(points, rel=1.2), {"reverse_kl": 3.0}, {"used": 6, "budget": 6})
  assert v.label == "inconclusive (underpowered)" and "seeds cannot lower it" in v.reason
  assert v.reason.endswith("tolerance set by the floor") and v.evidence["tolerance_set_by"] == {"reverse_kl": "floor"}
  v = V.budget_bracket(points, fit_for(points), {"reverse_kl": 3.0},
                       {"used": 6, "budget": 6, "ceiling": "noise_sigma=12.8"})
  assert v.reason.endswith("tolerance set by the clean spread"), v.reason
  # b fails clearly: an upper bound only; without it, the ceiling is the reason of a lower bound.
  low = [points[0], point("a", 0.5, 1.0)]
  v = V.budget_bracket(low, fit_for(low), {"reverse_kl": 3.0}, {"used": 6, "budget": 6, "ceiling": "noise_sigma=12.8"})
  assert v.label == "inconclusive (lower bound only)" and "ceiling noise_sigma=12.8" in v.reason
  assert "lower bound up to 0.5" in v.reason


def rows(*spec):
  return [{"name": f"c{i}", "verdict": verdict, "quality_ok": ok} for i, (verdict, ok) in enumerate(spec)]


def test_claim5_holds_only_beating_both_trivial_rules():
  v = V.admission_vs_trivial(rows(("accept", True), ("accept", True), ("reject", False), ("reject", False),
                                  ("reject", True)), True)
  assert v.outcome == "holds", v.reason
  assert (v.evidence["agree"], v.evidence["accept_all"], v.evidence["reject_all"]) == (4, 3, 2)


def test_claim5_does_not_hold():
  fa = V.admission_vs_trivial(rows(("accept", True), ("accept", False), ("reject", False)), True)
  assert fa.outcome == "does not hold" and fa.evidence["false_accepts"] == ["c1"]
  # No false accept but too strict: 3/5 right, accept-all 4/5.
  strict = V.admission_vs_trivial(rows(("accept", True), ("reject", True), ("reject", True), ("accept", True),
                                       ("reject", False)), True)
  assert strict.outcome == "does not hold" and "no better" in strict.reason


def test_claim5_inconclusive_when_candidates_do_not_straddle_or_the_budget_is_untrusted():
  # The SmolLM2 run's shape: 5/6 right, no false accept, but nothing degraded (accept-all scores 6/6).
  v = V.admission_vs_trivial(rows(*[("accept", True)] * 5, ("reject", True)), True)
  assert v.outcome == "inconclusive" and "do not straddle" in v.reason
  assert V.admission_vs_trivial(rows(("accept", True), ("reject", False)), False).outcome == "inconclusive"
  # An untrusted budget decides nothing, a false accept included (its quality labels mean nothing).
  untrusted = V.admission_vs_trivial(rows(("accept", False), ("reject", False)), False)
  assert untrusted.outcome == "inconclusive" and "untrusted" in untrusted.reason


def test_claim5_a_false_accept_decides_even_when_the_candidates_do_not_straddle():
  # Every candidate degraded and one was accepted: the claim's "no false accepts" failed, whatever the
  # trivial rules score (the rule said "inconclusive" here before, while its falsifier was met).
  v = V.admission_vs_trivial(rows(("accept", False), ("reject", False), ("reject", False)), True)
  assert v.outcome == "does not hold" and v.evidence["false_accepts"] == ["c0"], v.reason
  assert V.FALSIFIER["5"].met(v.evidence)


def ps_view(name, ps, raw, tis, shared=0.0):
  return {"view": name, "prefix_shift": ps, "total_raw": raw, "total_tis": tis, "prefix_shift_shared": [shared] * 3}


FLOOR = {"prefix_shift": [0.24, 0.25, 0.23]}


def test_claim4_holds_where_a_part_clears_the_floor_and_tis_helps():
  v = V.prefix_shift_vs_floor([ps_view("noise", [0.50, 0.52, 0.55], [2.5, 2.4, 2.6], [0.9, 0.8, 1.0]),
                               ps_view("fp8", [0.23, 0.26, 0.24], [1.6, 1.7, 1.6], [0.45, 0.4, 0.5])], FLOOR)
  assert v.outcome == "holds", v.reason
  assert [r["clears_floor"] for r in v.evidence["views"]] == [True, False]


def test_claim4_inconclusive_at_the_floor_or_with_one_replicate_or_a_failed_sanity_check():
  # The SmolLM2 run's shape: parts 0.232-0.252 against a floor of 0.243.
  at_floor = V.prefix_shift_vs_floor([ps_view("fp8", [0.23, 0.25, 0.24], [1.6, 1.7, 1.6], [0.45, 0.4, 0.5])], FLOOR)
  assert at_floor.outcome == "inconclusive" and "floor" in at_floor.reason
  one = V.prefix_shift_vs_floor([{**ps_view("n", [0.9], [2.0], [1.0]), "prefix_shift_shared": [0.0]}],
                                {"prefix_shift": [0.2]})
  assert one.outcome == "inconclusive" and "one replicate" in one.reason
  json.dumps(one.to_dict())
  broken = V.prefix_shift_vs_floor([ps_view("n", [0.9, 0.8, 1.0], [2, 2, 2], [1, 1, 1], shared=1e-3)], FLOOR)
  assert broken.outcome == "inconclusive" and "sanity" in broken.reason


def test_claim4_inconclusive_when_tis_removed_error_has_an_interval_reaching_0():
  # noise clears the floor; raw - TIS is 0.5, -0.1, 0.6 over the replicates: mean > 0, interval reaching 0.
  v = V.prefix_shift_vs_floor([ps_view("noise", [0.50, 0.52, 0.55], [2.5, 2.4, 2.6], [2.0, 2.5, 2.0])], FLOOR)
  assert v.outcome == "inconclusive" and "interval reaching 0 in each" in v.reason, v.reason
  lo, hi = v.evidence["views"][0]["tis_removed"][1:]
  assert v.evidence["views"][0]["clears_floor"] and lo <= 0 < hi


def test_claim4_counts_a_view_against_the_same_seed_floor_not_unrelated_samples():
  """The addition study's shape (2026-12-05): lag's part 0.63 [0.15, 1.12] under the unrelated-sample floor
  0.95 [0.33, 1.57] counts against the same stream's floor (0: nothing diverges); the unrelated floor stays an
  upper reference in the evidence. TIS's removal counts where its interval clears 0, one unclear view or not."""
  floor = {"prefix_shift": [0.0, 0.0, 0.0], "unrelated": [0.7, 0.95, 1.2]}
  views = [ps_view("lag=16", [0.45, 0.63, 0.81], [2.5, 2.4, 2.6], [0.9, 0.8, 1.0]),
           ps_view("noise", [0.2, 0.25, 0.3], [2.5, 2.4, 2.6], [2.0, 2.5, 2.0])]
  v = V.prefix_shift_vs_floor(views, floor)
  assert v.outcome == "holds", v.reason
  assert [r["clears_floor"] for r in v.evidence["views"]] == [True, True]
  assert [r["above_unrelated"] for r in v.evidence["views"]] == [False, False]
  assert "TIS removes error (interval above 0) in lag=16; unclear in noise" in v.reason
  assert v.evidence["floor_kind"] == "same seed" and v.evidence["unrelated"][0] == pytest.approx(0.95)
  old = V.prefix_shift_vs_floor(views, {"prefix_shift": floor["unrelated"]})  # the old rule's floor: nothing counts
  assert old.outcome == "inconclusive" and not any(r["clears_floor"] for r in old.evidence["views"])


def test_claim4_does_not_hold_when_tis_removes_nothing():
  v = V.prefix_shift_vs_floor([ps_view("lag", [0.6, 0.62, 0.61], [1.0, 1.1, 1.0], [1.2, 1.3, 1.25])], FLOOR)
  assert v.outcome == "does not hold" and "lag" in v.reason


def heldout(recipe, edge):
  return {"recipe_kl": float(np.mean(recipe)), "edge_kl": float(np.mean(edge)), "random_kl": 0.26,
          "num_prompts": len(recipe), "recipe_kl_prompts": recipe, "edge_kl_prompts": edge}


def test_claim2_out_of_sample_with_an_interval_over_prompts():
  ins = {"recipe_kl": 0.12, "edge_kl": 0.29, "random_kl": 0.27, "num_prompts": 12}
  rng = np.random.default_rng(0)
  edge = (0.28 + 0.05 * rng.standard_normal(12)).tolist()
  better = (np.asarray(edge) - 0.1 + 0.02 * rng.standard_normal(12)).tolist()
  v = V.recipe_out_of_sample([2, 10], [0, 19], ins, heldout(better, edge))
  assert v.outcome == "holds" and v.evidence["difference"][2] < 0, v.reason
  worse = (np.asarray(edge) + 0.05 + 0.02 * rng.standard_normal(12)).tolist()
  v = V.recipe_out_of_sample([2, 10], [0, 19], ins, heldout(worse, edge))
  assert v.outcome == "does not hold" and v.evidence["difference"][1] >= 0, v.reason  # in-sample it beat them
  # A lower mean by a margin inside the prompts' spread: the interval reaches 0.
  noisy = (np.asarray(edge) - 0.01 + 0.1 * rng.standard_normal(12)).tolist()
  v = V.recipe_out_of_sample([2, 10], [0, 19], ins, heldout(noisy, edge))
  lo, hi = v.evidence["difference"][1:]
  assert v.outcome == "inconclusive" and lo < 0 < hi and "reaches 0" in v.reason, v.reason
  # 8 held-out prompts (the SmolLM2 run's): no verdict from the interval, even a clear one.
  v = V.recipe_out_of_sample([2, 10], [0, 19], ins, heldout(better[:8], edge[:8]))
  assert v.outcome == "inconclusive" and "needs at least 9" in v.reason
  # ... a larger recipe KL over 8 prompts is not "does not hold" either: the falsifier asks for 9.
  assert V.recipe_out_of_sample([2, 10], [0, 19], ins, heldout(worse[:8], edge[:8])).outcome == "inconclusive"
  assert V.recipe_out_of_sample([0, 1], [1, 0], ins, heldout(edge, edge)).outcome == "inconclusive"
  assert "in-sample only" in V.recipe_out_of_sample([2, 10], [0, 19], ins, None).reason
  old = {k: v for k, v in heldout(better, edge).items() if not k.endswith("_prompts")}  # a result of before
  assert "no per-prompt" in V.recipe_out_of_sample([2, 10], [0, 19], ins, old).reason


def test_a_verdict_outside_the_three_outcomes_is_refused():
  with pytest.raises(ValueError, match="outcome"):
    V.Verdict("1", "holds (mostly)", "", "", {})


def test_study_design_places_candidates_around_the_budget():
  from opdjax.analyses import study_design

  clean = {"view": "clean", "mismatch": 0.0, "reverse_kl": CLEAN}
  failed = [clean, point("noise_sigma=0.4", 0.2, 1.01), point("noise_sigma=0.8", 0.9, 2.5)]
  fams = {"clean": "clean", "noise_sigma=0.4": "noise", "noise_sigma=0.8": "noise"}
  budget = {"budget": 0.2, "fit": fit_for(failed),
            "points": [{**p, "family": fams[p["view"]], "pass": p["mismatch"] < 0.5} for p in failed]}
  lines = study_design.candidates("*>fp8_e4m3", 4, budget).splitlines()
  noise = {ln.split(":")[0]: float(ln.split("=")[1]) for ln in lines if ln.startswith("noise-")}
  assert noise == {"noise-below-0.28": 0.28, "noise-between-0.566": 0.566, "noise-beyond-1.2": 1.2}
  assert len(lines) == 7 and "lag2: lag=2" in lines
  # A view failing by its median only (interval reaching the tolerance) does not place the failing side
  # when a clearly failing one exists: the "beyond" candidate is 1.5x the clear failure.
  fams["noise_sigma=0.6"] = "noise"
  wobbly = {"view": "noise_sigma=0.6", "mismatch": 0.6, "reverse_kl": [0.9, 1.3, 1.5], "family": "noise", "pass": False}
  budget["points"].insert(2, wobbly)
  budget["fit"] = fit_for(budget["points"])
  lines = study_design.candidates("*>fp8_e4m3", 4, budget).splitlines()
  assert "noise-beyond-1.2: noise_sigma=1.2" in lines


def test_seeds_for_power_come_from_the_clean_spread():
  from opdjax.analyses import study_design

  def seeds(clean, start=3.0, pilot=3, max_seeds=12, **extra):
    return study_design.seeds_for_power({"reverse_kl": clean, **extra}, {"reverse_kl": start, "accuracy": 0.0},
                                        3.0, pilot, max_seeds)

  assert seeds(CLEAN)["seeds"] == 3  # a tight clean spread: the pilot's 3 seeds suffice (2 needed)
  wide = [0.5, 1.0, 1.5]  # std 0.5, gain 2: n >= 2 * (2 * 3 * 0.5 / 2)^2 = 4.5
  got = seeds(wide)
  assert got["seeds"] == 5 and got["needed"] == {"reverse_kl": 5} and got["clean_std"]["reverse_kl"] == 0.5
  assert seeds(wide, max_seeds=4)["seeds"] == 4  # the run budget caps it; the verdict then says underpowered
  assert seeds(wide, start=0.5) == {"seeds": 3, "needed": {"reverse_kl": None}, "max_seeds": 12,
                                    "clean_std": {"reverse_kl": 0.5}, "floor_limits": []}  # no learning
  # A floor of 60% of the clean 1.0 exceeds half the 2.0 gain: seeds cannot give power, and it is said.
  assert seeds(CLEAN)["floor_limits"] == [] and study_design.seeds_for_power(
      {"reverse_kl": CLEAN}, {"reverse_kl": 3.0}, 3.0, 3, 12, tolerance_rel=1.2)["floor_limits"] == ["reverse_kl"]
  # Accuracy improves upward; the most-needing metric decides (std 0.2, gain 0.4: 2 * 3^2 = 18).
  got = seeds(CLEAN, accuracy=[0.2, 0.4, 0.6], max_seeds=20)
  assert got["needed"] == {"reverse_kl": 2, "accuracy": 18} and got["seeds"] == 18


# --- each rule against its written falsifier -------------------------------------------------------

def random_verdicts(rng, n=150):
  """Rule outcomes on random stage results (every branch of every rule among them)."""
  out = []
  for _ in range(n):
    clean = (1.0 + rng.uniform(0.005, 0.05) * rng.standard_normal(3)).tolist()
    pts = [{"view": "clean", "mismatch": 0.0, "reverse_kl": clean}]
    for i in range(rng.integers(1, 5)):
      c = 1.0 + rng.choice([0.0, 0.05, 0.3, 1.5]) * rng.uniform(0, 1)
      pts.append({"view": f"v{i}", "mismatch": float(rng.uniform(0, 2)),
                  "reverse_kl": (c + rng.uniform(0.0, 0.3) * rng.standard_normal(3)).tolist()})
    fit = fit_for(pts, rel=float(rng.choice([0.0, 0.05, 0.6])))
    if rng.uniform() < 0.2:
      fit["budget"] = float(rng.uniform(0, 2))  # a fit that need not agree with the verdict's bracket
    out.append(V.budget_bracket(pts, fit, {"reverse_kl": float(rng.choice([1.01, 1.5, 3.0]))},
                                {"used": 9, "budget": 12}))
    k = int(rng.integers(2, 14))
    edge = 0.3 + 0.05 * rng.standard_normal(k)
    rec = edge + rng.choice([-0.1, 0.0, 0.05]) + rng.uniform(0.001, 0.1) * rng.standard_normal(k)
    layers = [0, 19] if rng.uniform() < 0.15 else [2, 10]
    out.append(V.recipe_out_of_sample(layers, [0, 19], {}, heldout(rec.tolist(), edge.tolist())))
    reps = int(rng.integers(1, 4))
    views = [ps_view(f"w{i}", (rng.choice([0.2, 0.6]) + 0.03 * rng.standard_normal(reps)).tolist(),
                     (2.0 + 0.1 * rng.standard_normal(reps)).tolist(),
                     (2.0 + rng.choice([-1.0, -0.05, 0.3]) + 0.2 * rng.standard_normal(reps)).tolist(),
                     shared=float(rng.choice([0.0, 0.0, 0.0, 1e-3]))) for i in range(rng.integers(1, 3))]
    views = [{**v, "prefix_shift_shared": v["prefix_shift_shared"][:reps]} for v in views]
    out.append(V.prefix_shift_vs_floor(views, {"prefix_shift": (0.25 + 0.01 * rng.standard_normal(reps)).tolist()}))
    out.append(V.admission_vs_trivial(rows(*[(str(rng.choice(["accept", "reject"])), bool(rng.uniform() < 0.6))
                                             for _ in range(rng.integers(1, 7))]), bool(rng.uniform() < 0.85)))
  return out


def test_every_rule_says_does_not_hold_exactly_when_its_written_falsifier_is_met():
  got = random_verdicts(np.random.default_rng(1))
  for v in got:
    f = V.FALSIFIER[v.claim]
    assert v.falsifier == V.FALSIFIERS[v.claim] == f.text
    assert all(c.text in v.falsifier for c in (f.event, *f.when))  # the words are the clauses tested
    assert (v.outcome == "does not hold") == f.met(v.evidence), (v.claim, v.outcome, v.reason)
    if v.outcome == "holds":  # evidence only if the run could have produced the other verdict
      assert all(c.test(v.evidence) for c in f.when), (v.claim, v.reason)
    json.dumps(v.to_dict())
  reached = {(v.claim, v.outcome) for v in got}
  assert reached == {(c, o) for c in ("1", "2", "4", "5") for o in V.OUTCOMES}, sorted(reached)
