"""opdjax.analyses.bracket (`opdjax calibrate --bracket`): the rule on a deterministic quality
function of the noise sigma, then the command on the demo at tiny size."""

import json
import math

import numpy as np
import pytest

from opdjax.analyses import admission, bracket
from opdjax.cli import main

SEED_NOISE = (-1.0, 0.0, 1.0, -0.5, 0.5, -0.25, 0.25, 0.0)  # seed s's deviation, x each view's spread


def quality(sigma: float, seed: int, onset: float, spread: float = 0.02) -> float:
  """Final held-out reverse KL of a run at noise `sigma`: clean 1.0; the loss grows past `onset`
  (sigma^2 / onset^2 - 1, so about 1 at 1.4x the onset); seeds spread by `spread` (4x past onset)."""
  loss = max(0.0, sigma ** 2 / onset ** 2 - 1.0)
  s = spread * (4 if sigma > onset else 1)
  return 1.0 + loss + s * SEED_NOISE[seed % len(SEED_NOISE)]


def mismatch(sigma: float) -> float:
  return 5.0 * (1 - math.exp(-sigma))  # grows, then saturates like the addition task's ladder


def run_bracket(views, onset, seeds=2, max_seeds=8, ceiling=12.8, max_runs=0, spread=None):
  """The calibration's bracket loop (admission.calibrate's) with `quality` standing in for training."""
  spreads = spread or {}

  def runs(view, n, have=()):
    sigma = 0.0 if view == "clean" else float(view.split("=")[1])
    return [*have, *(quality(sigma, s, onset, spreads.get(view, 0.02)) for s in range(len(have), n))]

  def point(view, n):
    sigma = 0.0 if view == "clean" else float(view.split("=")[1])
    return {"view": view, "mismatch": mismatch(sigma), "reverse_kl": runs(view, n)}

  points = [point(v, seeds) for v in views]
  fit = admission.fit_budget(points, seeds, 2.0, 0.0)
  steps = []
  while True:
    step = bracket.next_step(points, fit, seeds, max_seeds, 2.0, ceiling, max_runs)
    steps.append(step)
    if step.kind == "stop":
      break
    if step.kind == "seeds":
      p = next(p for p in points if p["view"] == step.view)
      p["reverse_kl"] = runs(step.view, step.seeds, p["reverse_kl"])
    else:
      points.append(point(step.view, step.seeds))
    fit = admission.fit_budget(points, seeds, 2.0, 0.0)
  return points, fit, steps


def test_the_clean_view_is_topped_up_to_the_most_seeds_any_view_has():
  """A straddling view doubled to 4 seeds is followed by the clean view to 4: its loss is a median against
  clean's, which would otherwise rest on fewer draws than the view's."""
  points, fit, steps = run_bracket(["clean", "noise_sigma=0.6", "noise_sigma=1.2"], onset=1.1,
                                   spread={"noise_sigma=1.2": 0.05})
  kinds = [(s.kind, s.view, s.seeds) for s in steps]
  assert kinds[:2] == [("seeds", "noise_sigma=1.2", 4), ("seeds", "clean", 4)], kinds
  assert len(points[0]["reverse_kl"]) == max(len(p["reverse_kl"]) for p in points)


def test_the_ladder_doubles_until_a_view_fails_clearly():
  points, fit, steps = run_bracket(["clean", "noise_sigma=0.1", "noise_sigma=0.2"], onset=1.0)
  assert [s.view for s in steps if s.kind == "view"] == ["noise_sigma=0.4", "noise_sigma=0.8", "noise_sigma=1.6"]
  assert steps[-1].reason.startswith("bracketed: noise_sigma=1.6")
  side = bracket.sides(points, fit, steps[-1], 12.8)
  assert side["status"] == "bracketed" and side["high"]["view"] == "noise_sigma=1.6"
  assert side["low"]["view"] == "noise_sigma=0.8" and side["low"]["mismatch"] < side["high"]["mismatch"]
  assert side["statement"].startswith("between noise_sigma=0.8") and "noise_sigma=1.6" in side["statement"]
  json.dumps(side)


def test_without_a_failure_the_ceiling_makes_a_stated_lower_bound():
  points, fit, steps = run_bracket(["clean", "noise_sigma=0.4"], onset=100.0, ceiling=3.2)
  assert [s.view for s in steps if s.kind == "view"] == ["noise_sigma=0.8", "noise_sigma=1.6", "noise_sigma=3.2"]
  assert steps[-1].kind == "stop" and steps[-1].reason.startswith("ceiling: the next rung noise_sigma=6.4")
  side = bracket.sides(points, fit, steps[-1], 3.2)
  assert side["status"] == "ceiling" and side["high"] is None
  assert side["statement"] == f"lower bound up to {mismatch(3.2):.4g} (noise_sigma=3.2; ceiling noise_sigma=3.2)"


def test_a_straddling_view_gets_seeds_until_its_interval_falls_on_one_side():
  # At sigma 1.2 (onset 1.1) the loss 0.19 sits just above the tolerance with a wide spread: the interval
  # straddles at 2 seeds; doubled seeds narrow it until it lies above the tolerance.
  points, fit, steps = run_bracket(["clean", "noise_sigma=0.6", "noise_sigma=1.2"], onset=1.1,
                                   spread={"noise_sigma=1.2": 0.05})
  assert [(s.kind, s.view, s.seeds) for s in steps if s.view != "clean"][:2] == [("seeds", "noise_sigma=1.2", 4),
                                                                               ("seeds", "noise_sigma=1.2", 8)]
  p = next(p for p in points if p["view"] == "noise_sigma=1.2")
  assert len(p["reverse_kl"]) == 8
  rows = {r["view"]: r for r in bracket.classify(points, fit)}
  assert rows["noise_sigma=1.2"]["clear_fail"] and steps[-1].reason.startswith("bracketed: noise_sigma=1.2")
  assert not any(s.kind == "view" for s in steps)  # the refined view brackets it: no rung needed


def test_seeds_stop_at_max_seeds_and_the_run_budget_stops_the_ladder():
  points, fit, steps = run_bracket(["clean", "noise_sigma=0.6", "noise_sigma=1.2"], onset=1.1, max_seeds=4,
                                   spread={"noise_sigma=1.2": 0.05})
  assert max(len(p["reverse_kl"]) for p in points) == 4
  assert ("seeds", "noise_sigma=1.2", 4) in [(s.kind, s.view, s.seeds) for s in steps]
  _, _, steps = run_bracket(["clean", "noise_sigma=0.1"], onset=100.0, max_runs=8)  # 4 runs used, 2 per rung
  assert [s.view for s in steps if s.kind == "view"] == ["noise_sigma=0.2", "noise_sigma=0.4"]
  assert steps[-1].reason == "run budget: 8 of 8 runs spent, a new view needs 2"


def test_a_ladder_without_noise_views_starts_at_the_first_rung():
  step = bracket.next_step([{"view": "clean", "mismatch": 0.0, "reverse_kl": [1.0, 1.02]},
                            {"view": "weights=fp8", "mismatch": 0.1, "reverse_kl": [1.0, 1.01]}],
                           {"metrics": ["reverse_kl"], "tolerance": {"reverse_kl": 0.05}}, 2, 8, 2.0, 12.8)
  assert (step.kind, step.view, step.seeds) == ("view", f"noise_sigma={bracket.FIRST_SIGMA}", 2)


@pytest.mark.slow
def test_calibrate_bracket_on_the_demo(demo_cache, tmp_path, capsys):
  out = tmp_path / "cal"
  small = ["--config.task.num_eval=16", "--config.rollout.batch_size=8", "--config.calibrate.steps=2",
           "--config.calibrate.seeds=2", "--config.calibrate.eval_every=2", "--config.calibrate.warmup_steps=1",
           "--config.calibrate.num_prompts=16", "--config.admit.bootstrap=50", "--config.calibrate.force=true",
           "--config.calibrate.views=clean;noise_sigma=0.5", "--config.calibrate.bracket_ceiling=2.0",
           "--config.calibrate.max_seeds=3"]  # 2 steps cannot learn: forced
  assert main(["calibrate", "--bracket", "--out", str(out), *small]) == 0
  budget = json.loads((out / "budget.json").read_text())
  side = budget["bracket"]
  views = [p["view"] for p in budget["points"]]
  assert views[:2] == ["clean", "noise_sigma=0.5"] and budget["extension"]["added"] == views[2:]
  # Either a clear failure brackets it, or the ladder ran to its ceiling (1.0, 2.0, then 4.0 > 2.0).
  assert side["status"] in ("bracketed", "ceiling"), side
  if side["status"] == "ceiling":
    assert views[2:] == ["noise_sigma=1.0", "noise_sigma=2.0"] and side["high"] is None
    assert side["statement"].startswith("lower bound up to") and "ceiling noise_sigma=2" in side["statement"]
  else:
    assert side["high"]["view"] in views
  assert side["steps"][-1]["kind"] == "stop" and budget["extension"]["runs"] == sum(
      len(p["reverse_kl"]) for p in budget["points"])
  assert all(2 <= len(p["reverse_kl"]) <= 3 for p in budget["points"])  # straddlers may get a third seed
  assert budget["fit"]["tolerance_set_by"]["reverse_kl"] in ("clean spread", "floor")
  printed = capsys.readouterr().out
  assert f"bracket: {side['statement']}" in printed and "set by the" in printed
  assert budget["config"]["calibrate"]["bracket"] is True
  assert np.isfinite(side["largest_tried"]["mismatch"])


@pytest.mark.parametrize("key,value,match", [("bracket_factor", 1.0, "must grow"), ("bracket_ceiling", 0.0, "> 0"),
                                             ("max_seeds", 0, "must be >= 1"), ("max_runs", -1, "no cap")])
def test_bad_bracket_settings_are_user_errors(key, value, match):
  from opdjax.config.defaults import default_config
  from opdjax.config.schema import build
  from opdjax.errors import UserError

  c = default_config()
  c.calibrate[key] = value
  with pytest.raises(UserError, match=match):
    build(c)
