"""The Python API on the demo: `opdjax.train(None, out=..., overrides=...)` returns the run's records, its
params and evaluate(); the demo's verifier scores the logged samples."""

import json

import pytest

import opdjax
from opdjax.errors import UserError


@pytest.mark.slow
def test_a_short_demo_run_from_python(demo_cache, tmp_path):
  out = tmp_path / "run"
  run = opdjax.train(None, out=out, progress=False,
                     overrides={"train.steps": 4, "train.eval_every": 2, "train.log_samples_every": 2,
                                "rollout.batch_size": 16, "task.num_eval": 32})
  assert [r["step"] for r in run.records] == [0, 1, 2, 3, 4]
  assert run.records == run.metrics()  # what metrics.jsonl holds
  assert {"reverse_kl", "accuracy"} <= set(run.records[-1]) and run.records[-1]["eval_step"] == 4
  got = run.evaluate()  # the exported student, re-evaluated: the last record's held-out numbers
  assert got["reverse_kl"] == pytest.approx(run.records[-1]["reverse_kl"], rel=1e-4)
  assert got["accuracy"] == pytest.approx(run.records[-1]["accuracy"])
  samples = [json.loads(line) for line in open(out / "samples.jsonl")]
  assert [s["step"] for s in samples] == [2] * 4 + [4] * 4
  assert all(s["reward"] in (0.0, 1.0) for s in samples)  # the addition task's verifier, per sample
  assert any(s["ended"] == "eos" for s in samples)  # the SFT'd student ends its answers
  # The same folder resumes: nothing left to run, no records, the params as they were
  again = opdjax.train(None, out=out, progress=False, overrides={"train.steps": 4, "train.eval_every": 2,
                                                                 "train.log_samples_every": 2,
                                                                 "rollout.batch_size": 16, "task.num_eval": 32})
  assert again.records == [] and again.result.final_step == 4


def test_bad_input_from_python_raises_before_out_exists(tmp_path):
  with pytest.raises(UserError, match="unknown config key --config.train.stepz"):
    opdjax.train(None, out=tmp_path / "run", overrides={"train.stepz": 3})
  with pytest.raises(UserError, match="needs out=FOLDER"):
    opdjax.train(None)
  assert not (tmp_path / "run").exists()
