"""scripts/time_to_quality.py: the headline against the best synchronous layout, its target, bound and flags.

The pure parts on run records built here (which configuration is fastest, a flagged run left out, the
interpolated crossing, the target every run crosses, the CPU bound); the script itself, --quick, on
real runs of both layouts (slow)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("time_to_quality", os.path.join(ROOT, "scripts", "time_to_quality.py"))
ttq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttq)


def _run(config, seed, to_rkl, wall=10.0, flagged=False, placement="colocated", cpu=(15.0, 0.0)):
  return {"config": config, "seed": seed, "seconds_to_reverse_kl": to_rkl, "wall_s_at_equal_steps": wall,
          "flagged": flagged, "placement": placement, "trainer_cpus": [0] if placement == "disaggregated" else [0, 1],
          "cpu_s": {"trainer_process": cpu[0], "engine_process": cpu[1]}}


def test_the_headline_is_against_the_fastest_sync_by_median_and_leaves_flagged_runs_out():
  by = {"sync_fp32": [_run("sync_fp32", s, t) for s, t in enumerate((5.0, 6.0, 5.5))],
        "sync_disaggregated_teacher_engine": [_run("sync_disaggregated_teacher_engine", s, t, placement="disaggregated",
                                                   cpu=(8.0, 6.0)) for s, t in enumerate((4.0, 9.0, 8.0))],
        "async_k1": [_run("async_k1", s, t) for s, t in enumerate((5.0, 5.0, 5.0))],
        "async_k1_disaggregated_teacher_engine": [
            _run("async_k1_disaggregated_teacher_engine", s, t, placement="disaggregated")
            for s, t in enumerate((4.0, 4.4, None))]}
  by["async_k1_disaggregated_teacher_engine"][1]["flagged"] = True
  h = ttq.headline(by, "seconds_to_reverse_kl", cores=2)
  # sync_fp32's median (5.5) beats the disaggregated one's (8.0), although the latter's seed 0 is faster
  assert h["against"] == "sync_fp32"
  # the flagged seed is out of the async medians: (4.0, 10.0 whole run) -> 7.0 > async_k1's 5.0
  assert h["async"] == "async_k1" and h["async_medians_s"]["async_k1_disaggregated_teacher_engine"] == 7.0
  assert h["per_seed"] == pytest.approx([1.0, 1.2, 1.1]) and h["median"] == pytest.approx(1.1)
  assert h["excluded_seeds"] == []
  # colocated: 15 CPU s of work over 2 cores is 7.5 s at least, against a 10 s run
  assert h["physical_bound"] == pytest.approx(10.0 / 7.5, abs=1e-4)
  by["async_k1"][2]["flagged"] = True
  assert ttq.headline(by, "seconds_to_reverse_kl", cores=2)["excluded_seeds"] == [2]


def test_the_bound_of_a_disaggregated_run_is_its_busier_side_on_its_own_core():
  b = ttq.physical_bound(_run("sync_disaggregated", 0, 1.0, wall=10.0, placement="disaggregated", cpu=(6.0, 2.0)),
                         cores=2)
  assert b["bound"] == pytest.approx(10.0 / 6.0, abs=1e-4)  # not 10 / 4: the trainer's 6 s fit on its one core only


def test_seconds_to_a_target_interpolate_between_evaluations_and_the_auto_target_is_crossed_by_every_run():
  pts = [{"wall_s": 0.0, "reverse_kl": 8.0, "accuracy": 0.0}, {"wall_s": 2.0, "reverse_kl": 2.0, "accuracy": 0.5},
         {"wall_s": 4.0, "reverse_kl": 0.5, "accuracy": 0.9}]
  assert ttq.first_reaching(pts, "reverse_kl", 1.0, lambda v, t: v <= t) == pytest.approx(3.0)  # log-midpoint
  assert ttq.first_reaching(pts, "accuracy", 0.7, lambda v, t: v >= t) == pytest.approx(3.0)
  assert ttq.first_reaching(pts, "accuracy", 0.95, lambda v, t: v >= t) is None
  rng = np.random.default_rng(0)
  runs = []
  for _ in range(6):
    ends = np.sort(rng.uniform(0.01, 0.2, 1))
    curve = [{"wall_s": float(i), "reverse_kl": float(v), "accuracy": 0.0}
             for i, v in enumerate(np.geomspace(8.0, ends[0], 12))]
    runs.append({"curve": curve, "final_reverse_kl": curve[-1]["reverse_kl"]})
  target = ttq.auto_reverse_kl_target(runs)
  assert max(r["final_reverse_kl"] for r in runs) < target < 8.0
  assert all(ttq.first_reaching(r["curve"], "reverse_kl", target, lambda v, t: v <= t) is not None for r in runs)


@pytest.mark.slow
def test_quick_run_writes_the_headline_with_per_seed_values_bound_and_trainer_step_ratio(tmp_path):
  configs = "sync_fp32,async_k1,sync_disaggregated_teacher_engine,async_k1_disaggregated_teacher_engine"
  subprocess.run([sys.executable, "scripts/time_to_quality.py", "--quick", "--configs", configs, "--out",
                  str(tmp_path)], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=1200)
  r = json.load(open(tmp_path / "time_to_quality.json"))
  # On a loaded box every run is flagged and the headline has no seeds; the all-runs variant has them all.
  flagged = {(x["config"], x["seed"]) for x in r["runs"] if x["flagged"]}
  best = r["speedup_async_k1_vs_best_sync"]
  if best is not None:
    assert not any((n, s) in flagged for n in (best["against"], best["async"]) for s in best.get("seeds", []))
  h = r["speedup_async_k1_vs_best_sync_all_runs"]
  assert h["against"] in ("sync_fp32", "sync_disaggregated_teacher_engine")
  assert h["async"] in ("async_k1", "async_k1_disaggregated_teacher_engine")
  runs = {(x["config"], x["seed"]): x for x in r["runs"]}
  t = lambda x: x["seconds_to_reverse_kl"] or x["wall_s_at_equal_steps"]  # noqa: E731
  want = [t(runs[(h["against"], s)]) / t(runs[(h["async"], s)]) for s in h["seeds"]]
  assert h["per_seed"] == pytest.approx(want) and h["seeds"] == [0, 1] and h["excluded_seeds"] == []
  assert h["physical_bound"] >= 1.0
  for x in r["runs"]:
    assert set(x["curve"][0]) >= {"step", "wall_s", "accuracy", "reverse_kl", "load_1min"}
    assert x["flagged"] == bool(x["flag"])
  # the colocated async run with the teacher on the trainer, and each async run's trainer step ratio
  assert {"async_k1", "async_k1_disaggregated_teacher_engine"} <= set(r["configs"])
  assert all(r["configs"][n]["trainer_step_ratio_vs_sync"] > 0 for n in ("async_k1",
                                                                          "async_k1_disaggregated_teacher_engine"))
  assert {(x["placement"], x["teacher_scoring"]) for x in r["timed_syncs"]} == {("colocated", "trainer"),
                                                                               ("disaggregated", "engine")}
  assert r["num_eval"] == 64 and r["speedup_async_k1_vs_sync_disaggregated_teacher_engine_reverse_kl"] is not None
