"""Short runs from one start at different engine views (calibration, validation, OPD vs GRPO)."""

import json

import jax
import numpy as np
import pytest

from opdjax.analyses.sweep import stability, sweep_config, train_run
from opdjax.config.defaults import default_config
from opdjax.config.schema import build
from opdjax.errors import UserError
from opdjax.pipeline.session import Session
from opdjax.views.view import EngineView


def _records(norms, accs):
  recs = [{"step": 0, "accuracy": accs[0]}]
  for i, g in enumerate(norms):
    r = {"step": i + 1, "grad_norm": g, "loss": 1.0}
    if i + 1 < len(accs):
      r["accuracy"] = accs[i + 1]
    recs.append(r)
  return recs


def test_stability_counts_spikes_and_collapse():
  calm = stability(_records([1.0] * 30, [0.1, 0.5, 0.8, 0.9]))
  assert not calm.collapsed and calm.grad_norm_spikes == 0 and calm.best_accuracy == 0.9
  norms = [1.0] * 30
  norms[10], norms[20] = 50.0, 6.0
  spiky = stability(_records(norms, [0.1, 0.8, 0.9, 0.2]))
  assert spiky.grad_norm_spikes == 2 and spiky.max_grad_norm == 50.0
  assert spiky.collapsed and spiky.final_accuracy == 0.2  # 0.2 < half of the best 0.9
  bad = _records([1.0] * 10, [0.1, 0.2])
  bad[5]["grad_norm"] = float("nan")
  assert stability(bad).collapsed and stability(bad).nonfinite_steps == 1


def _config(**grpo):
  cfg = default_config()
  cfg.task.num_eval = 16
  cfg.rollout.batch_size = 16
  cfg.grpo.group_size = 4
  cfg.grpo.update(grpo)
  return sweep_config(build(cfg), steps=3, eval_every=2)


@pytest.fixture(scope="module")
def runner(demo_cache):
  return Session(_config(), progress=False)


@pytest.mark.slow
def test_noise_is_seeded_per_run_and_version(runner):
  view = EngineView(noise_sigma=0.1)
  p = runner.student_params
  engine = runner.engines.get(view)
  a, b = runner.engine_params(engine, view, p, 3, seed=0), runner.engine_params(engine, view, p, 3, seed=0)
  c, d = runner.engine_params(engine, view, p, 4, seed=0), runner.engine_params(engine, view, p, 3, seed=1)
  leaf = lambda t: np.asarray(t["layers"]["mlp"]["down_proj"]["kernel"][0])
  np.testing.assert_array_equal(leaf(a), leaf(b))
  assert not np.array_equal(leaf(a), leaf(c)) and not np.array_equal(leaf(a), leaf(d))
  rel = np.std(leaf(a) - leaf(p)) / np.sqrt(np.mean(leaf(p) ** 2))
  np.testing.assert_allclose(rel, 0.1, rtol=0.15)
  assert runner.engine_params(engine, EngineView(), p, 3, seed=0) is p  # the clean view is the trainer's params


@pytest.mark.slow
def test_opd_and_grpo_runs_reuse_one_compiled_step(runner):
  start = jax.tree.map(np.asarray, runner.student_params)
  for view in (EngineView(), EngineView(noise_sigma=0.6, lag=1)):
    for algo in ("opd", "grpo"):
      recs = train_run(runner, view, seed=0, algo=algo)
      assert [r["step"] for r in recs] == [0, 1, 2, 3]
      assert [r["eval_step"] for r in recs[1:]] == [0, 2, 3]  # step 1 carries step 0's evaluation; 2 and 3 evaluated
      assert all(np.isfinite(r["grad_norm"]) for r in recs[1:])
      assert recs[-1]["params_lag"] == view.lag
      if view.noise_sigma:
        assert recs[1]["mismatch_kl_k3_tok"] > 0
      else:
        assert recs[1]["mismatch_kl_k3_tok"] < 1e-6
  counts = runner.compiled_counts()
  assert counts["step_opd"] == 1 and counts["step_grpo"] == 1 and counts["noise"] == 1, counts
  # Every run started from the same params: the start was never donated away.
  jax.tree.map(np.testing.assert_array_equal, start, jax.tree.map(np.asarray, runner.student_params))


@pytest.mark.slow
def test_grpo_needs_whole_groups_and_a_known_algo(runner):
  odd = Session(_config(group_size=5), progress=False)  # 16 completions are not whole groups of 5
  with pytest.raises(UserError, match="multiple of grpo.group_size"):
    train_run(odd, EngineView(), seed=0, algo="grpo")
  with pytest.raises(UserError, match="algo"):
    runner.train_step("ppo")


@pytest.mark.slow
def test_compare_script_runs_both_algorithms(demo_cache, tmp_path, script):
  compare = script("compare_opd_grpo")
  assert compare.main(["--out", str(tmp_path), "--views", "clean;noise_sigma=0.5", "--steps", "2",
                       "--eval-every", "2", "--seeds", "1", "--config.student.sft_steps=100",
                       "--config.task.num_eval=16", "--config.rollout.batch_size=16",
                       "--config.grpo.group_size=4"]) == 0
  out = json.loads((tmp_path / "compare.json").read_text())
  assert {(r["algo"], r["view"]) for r in out["rows"]} == {(a, v) for a in ("opd", "grpo")
                                                            for v in ("clean", "noise_sigma=0.5")}
  assert out["compiled"]["step_opd"] == 1 and out["compiled"]["step_grpo"] == 1
  assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "grad_norm.png").stat().st_size > 0
