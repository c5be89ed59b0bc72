"""Budget calibration and the admission check."""

import json

import numpy as np
import pytest

from opdjax.analyses import admission
from opdjax.cli import main
from opdjax.errors import UserError
from opdjax.pipeline.guards import load_budget

pytestmark = pytest.mark.slow  # calibration and admission runs: the full suite runs them


def _point(view, mismatch, rkl, acc):
  return {"view": view, "mismatch": mismatch, "reverse_kl": list(rkl), "accuracy": list(acc)}


def test_fit_budget_arithmetic():
  points = [
      _point("clean", 0.0, [1.0, 1.2], [0.9, 0.9]),
      _point("a", 0.01, [1.1, 1.3], [0.9, 0.88]),  # loss 0.1 rKL, 0.01 acc: within
      _point("b", 0.05, [1.6, 1.8], [0.9, 0.9]),  # loss 0.6 rKL: out
      _point("c", 0.2, [1.0, 1.2], [0.9, 0.9]),  # passes, but above a failing mismatch
  ]
  fit = admission.fit_budget(points, seeds=2, tolerance_sigmas=2.0, tolerance_rel=0.05)
  s = np.std([1.0, 1.2], ddof=1)  # the clean runs' seed spread
  np.testing.assert_allclose(fit["tolerance"]["reverse_kl"], max(2.0 * s * np.sqrt(2 / 2), 0.05 * 1.1))
  np.testing.assert_allclose(fit["tolerance"]["accuracy"], 0.05 * 0.9)  # clean accuracy has no spread
  assert [p["pass"] for p in points] == [True, True, False, True]
  assert fit["budget"] == 0.01  # "c" passes but lies above the failing "b"
  assert fit["smallest_failing_mismatch"] == 0.05
  assert not fit["monotone"]
  np.testing.assert_allclose(points[2]["quality_loss"]["reverse_kl"], 0.6)
  # A clean-only failure pattern: nothing passes beyond clean -> budget 0.
  fit = admission.fit_budget([_point("clean", 0.0, [1.0, 1.0], [1, 1]), _point("x", 0.1, [3.0, 3.0], [0, 0])],
                             2, 2.0, 0.05)
  assert fit["budget"] == 0.0


def test_bootstrap_interval():
  rng = np.random.default_rng(0)
  kl = rng.exponential(0.1, (64, 10))
  mask = (rng.random((64, 10)) < 0.7).astype(np.float64)
  mean, lo, hi = admission.bootstrap_interval(kl, mask, 2000, 0.95)
  np.testing.assert_allclose(mean, (kl * mask).sum() / mask.sum())
  assert lo < mean < hi
  # Padding never enters: changing masked-out values changes nothing.
  kl2 = np.where(mask > 0, kl, 99.0)
  assert admission.bootstrap_interval(kl2, mask, 2000, 0.95) == (mean, lo, hi)
  # Identical sequences: a zero-width interval.
  m, lo, hi = admission.bootstrap_interval(np.ones((8, 4)), np.ones((8, 4)), 100, 0.9)
  assert m == lo == hi == 1.0


@pytest.mark.parametrize("text, msg", [
    ("fp8 weights=fp8\n", "is not 'NAME: ENGINE-VIEW'"),
    ("a: weights=fp9\n", "unknown recipe preset 'fp9'"),
    ("a: lagg=2\n", "bad engine-view item"),
    ("a: lag=1\na: lag=2\n", "names repeat (a)"),
    ("# only a comment\n\n", "lists no candidates"),
])
def test_bad_candidate_files(tmp_path, text, msg):
  path = tmp_path / "c.txt"
  path.write_text(text)
  with pytest.raises(UserError) as e:
    admission.read_candidates(str(path))
  assert msg in str(e.value)
  if "NAME" in msg or "fp9" in msg or "item" in msg:
    assert f"{path}:1:" in str(e.value)  # the line to fix


def test_bad_budget_files(tmp_path):
  with pytest.raises(UserError, match="opdjax calibrate"):
    load_budget(str(tmp_path / "missing.json"))
  (tmp_path / "cut.json").write_text('{"format": 1, "bud')
  with pytest.raises(UserError, match="not valid JSON"):
    load_budget(str(tmp_path / "cut.json"))


@pytest.mark.slow
def test_caveats_say_when_the_budget_is_a_lower_bound_and_the_tolerance_too_wide():
  """Clean seeds that disagree widen the tolerance past half of what OPD learned (accuracy here), and no view
  fails (the demo's fresh calibration, docs/admission.md, has the second only); both are said, with the seeds
  the study's power rule asks for."""
  start = {"reverse_kl": 8.0, "accuracy": 0.0}
  wide = [_point("clean", 0.0, [0.05, 0.75, 1.9], [0.9, 0.5, 0.2]), _point("noise", 3.3, [0.5, 0.4, 0.7],
                                                                         [0.6, 0.5, 0.4])]
  fit = admission.fit_budget(wide, seeds=3, tolerance_sigmas=2.0, tolerance_rel=0.05)
  got = admission.caveats(wide, fit, start)
  assert got[0] == "no view failed: the budget 3.3 is the largest mismatch tried, a lower bound"
  assert len(got) == 2 and got[1].startswith("the accuracy tolerance") and "(now 3)" in got[1]  # gain 0.5
  n = int(got[1].split("about ")[1].split(" seeds")[0])
  s = np.std([0.9, 0.5, 0.2], ddof=1)
  assert 2.0 * s * np.sqrt(2 / n) <= 0.5 / 2 < 2.0 * s * np.sqrt(2 / (n - 1))  # the fewest seeds, by the rule
  # Tight clean seeds and a view that fails: nothing to say.
  tight = [_point("clean", 0.0, [0.05, 0.06, 0.05], [0.98, 0.97, 0.98]), _point("a", 0.5, [0.05, 0.05, 0.06],
                                                                               [0.98, 0.98, 0.97]),
           _point("b", 1.0, [2.0, 2.5, 3.0], [0.5, 0.4, 0.3])]
  fit = admission.fit_budget(tight, seeds=3, tolerance_sigmas=2.0, tolerance_rel=0.05)
  assert fit["smallest_failing_mismatch"] == 1.0 and admission.caveats(tight, fit, start) == []


def test_calibrate_then_admit_end_to_end(demo_cache, tmp_path, capsys, script):
  out = tmp_path / "cal"
  small = ["--config.task.num_eval=32", "--config.rollout.batch_size=16", "--config.calibrate.steps=4",
           "--config.calibrate.seeds=2",
           "--config.calibrate.eval_every=2", "--config.calibrate.warmup_steps=2", "--config.calibrate.num_prompts=32",
           "--config.admit.bootstrap=200", "--config.calibrate.force=true"]  # 4 steps cannot learn: forced
  views = "--config.calibrate.views=clean;noise_sigma=0.5;noise_sigma=3.0;lag=2"
  assert main(["calibrate", "--out", str(out), views, *small]) == 0
  budget = json.loads((out / "budget.json").read_text())
  assert "did not improve" in budget["warning"]  # a forced budget says why it cannot be trusted
  printed = capsys.readouterr().out
  assert isinstance(budget["caveats"], list) and all(f"caveat: {c}" in printed for c in budget["caveats"])
  points = {p["view"]: p for p in budget["points"]}
  assert points["clean"]["mismatch"] == 0.0
  assert 0 < points["noise_sigma=0.5"]["mismatch"] < points["noise_sigma=3.0"]["mismatch"]
  assert all(len(p["reverse_kl"]) == 2 and len(p["accuracy"]) == 2 for p in budget["points"])
  # One compiled train step and one compiled noise transform across 4 views x 2 seeds.
  assert budget["provenance"]["compiled"]["step_opd"] == 1
  assert budget["provenance"]["compiled"]["noise"] == 1
  assert budget["provenance"]["compiled"]["measure_noise"] == 1  # the x-axis: 2 sigmas, one compile
  for name in ("budget.png", "calibration.csv", "calibration.md", "curves.json"):
    assert (out / name).stat().st_size > 0
  # Never overwritten.
  assert main(["calibrate", "--out", str(out), views, *small]) == 2
  # one --out policy for every command
  assert "`opdjax calibrate` does not resume into a used folder" in capsys.readouterr().err

  cands = tmp_path / "candidates.txt"
  cands.write_text("same: clean\nfp8: weights=fp8,kv_quant=fp8_e4m3  # FP8 weights + KV\nstale: lag=2\n"
                   "wild: noise_sigma=5.0\n")
  capsys.readouterr()
  assert main(["admit", "--budget", str(out / "budget.json"), "--candidates", str(cands),
               "--out", str(tmp_path / "adm")]) == 0
  table = capsys.readouterr().out
  result = json.loads((tmp_path / "adm" / "admission.json").read_text())
  rows = {r["name"]: r for r in result["candidates"]}
  for r in rows.values():
    assert r["ci_low"] <= r["mismatch"] <= r["ci_high"]
    assert r["verdict"] == ("accept" if r["ci_high"] <= budget["budget"] else "reject")
    assert r["name"] in table
  assert rows["same"]["mismatch"] == 0.0 and rows["same"]["verdict"] == "accept"
  # The same protocol as calibration: lag=2 measures what calibration measured.
  np.testing.assert_allclose(rows["stale"]["mismatch"], points["lag=2"]["mismatch"], rtol=1e-5)
  assert rows["wild"]["mismatch"] > points["noise_sigma=3.0"]["mismatch"]
  assert rows["fp8"]["kv_tokens_ratio"] > 1.5  # FP8 KV cache (and weights) hold more tokens
  assert (tmp_path / "adm" / "admission.png").stat().st_size > 0

  # scripts/validate_admission.py trains each candidate like a calibration point and judges it.
  validate = script("validate_admission")
  cands.write_text("same: clean\nwild: noise_sigma=5.0\n")
  assert validate.main(["--out", str(tmp_path / "val"), "--budget", str(out / "budget.json"),
                        "--candidates", str(cands)]) == 0
  val = json.loads((tmp_path / "val" / "validation.json").read_text())
  assert [r["name"] for r in val["rows"]] == ["same", "wild"] and val["total"] == 2
  same, wild = val["rows"]
  assert same["verdict"] == "accept" and wild["verdict"] == "reject"
  # Trained like the calibration's clean runs (same start, seeds, steps): the same quality.
  assert same["quality_ok"] and same["agrees"] and same["loss_reverse_kl"] == pytest.approx(0.0, abs=1e-6)
  assert wild["agrees"] == (not wild["quality_ok"])
  assert (tmp_path / "val" / "validation.png").stat().st_size > 0

  # A budget from another student is refused.
  budget["student_fingerprint"] = "0" * 16
  (tmp_path / "other.json").write_text(json.dumps(budget))
  assert main(["admit", "--budget", str(tmp_path / "other.json"), "--candidates", str(cands)]) == 2
  assert "different student" in capsys.readouterr().err
  # Overrides other than admit.* would change the scale the budget was measured on.
  assert main(["admit", "--budget", str(out / "budget.json"), "--candidates", str(cands),
               "--config.rollout.temperature=0.7"]) == 2
  assert "only --config.admit.*" in capsys.readouterr().err
  # A bad candidate is refused (naming it) before any measurement starts.
  cands.write_text("ok: weights=fp8\nbad: kv_quant=int8\n")
  assert main(["admit", "--budget", str(out / "budget.json"), "--candidates", str(cands)]) == 2
  assert "bad" in capsys.readouterr().err
  # A lag deeper than the protocol's history is one clear error.
  cands.write_text("deep: lag=9\n")
  assert main(["admit", "--budget", str(out / "budget.json"), "--candidates", str(cands)]) == 2
  assert "warmup_steps" in capsys.readouterr().err
