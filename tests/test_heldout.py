"""The held-out evaluation's teacher-side measures: the student's NLL on the teacher's greedy completions and
the token F1 of its greedy answers against the teacher's, computed once per run and reused on resume."""

import json
import os

import pytest

from opdjax import cli
from opdjax.pipeline import heldout
from opdjax.pipeline.heldout import TEACHER_FILE, token_f1


def test_token_f1_counts_tokens_as_bags():
  assert token_f1([5, 6, 7], [5, 6, 7]) == 1.0
  assert token_f1([], []) == 1.0 and token_f1([5], []) == 0.0 and token_f1([9, 9, 9], [5, 6, 7]) == 0.0
  # 2 of 4 predicted tokens in the 2-token reference: precision 0.5, recall 1
  assert token_f1([5, 6, 9, 9], [5, 6]) == pytest.approx(2 * 0.5 * 1.0 / 1.5)
  assert token_f1([5, 5, 5], [5, 6, 7]) == pytest.approx(1 / 3)  # repeats count once each side


@pytest.mark.slow
def test_teacher_side_measures_are_recorded_and_the_completions_cached_for_resume(demo_cache, tmp_path,
                                                                                  monkeypatch):
  out = str(tmp_path / "run")
  args = ["train", "--config", "configs/demo.py", "--out", out, "--config.train.steps=1",
          "--config.train.eval_every=1"]
  built = []
  real = heldout.jax_engine
  monkeypatch.setattr(heldout, "jax_engine", lambda model, **kw: built.append(model) or real(model, **kw))
  assert cli.main(args) == 0
  recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  for r in recs:
    assert r["teacher_nll"] > 0 and 0 <= r["teacher_f1"] <= 1, r
  assert len(built) == 2  # the student's held-out engine and the teacher's, once
  kept = json.load(open(os.path.join(out, TEACHER_FILE)))
  assert len(kept["completions"]) > 1 and all(kept["completions"])  # one a held-out prompt
  # The resumed run reads the teacher's completions back: no teacher engine. Made all-EOS here, so an F1 of
  # the student's non-empty answers against them is 0: the number really comes from the file.
  eos = kept["completions"][0][-1]
  kept["completions"] = [[eos] for _ in kept["completions"]]
  json.dump(kept, open(os.path.join(out, TEACHER_FILE), "w"))
  built.clear()
  assert cli.main(args[:-2] + ["--config.train.steps=2", "--config.train.eval_every=1"]) == 0
  assert len(built) == 1
  last = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][-1]
  assert last["step"] == 2 and last["teacher_f1"] < recs[-1]["teacher_f1"]
