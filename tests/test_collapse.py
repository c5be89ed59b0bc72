"""The collapse guard (opdjax.pipeline.guards.CollapseGuard) and the repetition fields it reads
(opdjax.rollout.base.repetition_fields, read by Rollout.lengths); the run-level test is a high learning rate on
the demo."""

import json

import numpy as np
import pytest

from opdjax.pipeline.guards import CollapseGuard, CollapseHalt
from opdjax.pipeline.loop import Loop
from opdjax.rollout.base import repetition_fields

EOS = 2


def _loop():
  return Loop(session=None, view=None, seed=0, steps=50, state=None, sampler=None, hooks=[])


def test_repetition_fields_of_varied_and_collapsed_completions():
  toks = np.array([[5, 6, 7, 8, EOS, 0], [9] * 6, [4, 5, 4, 5, 4, EOS], [3, EOS, 0, 0, 0, 0]])
  mask = np.array([[1] * 5 + [0], [1] * 6, [1] * 6, [1, 1, 0, 0, 0, 0]], bool)
  got = repetition_fields(toks, mask, (EOS,))
  # 19 tokens, 8 distinct (5, 6, 7, 8, 9, 4, 3 and EOS); row 0: nothing repeated; row 1: '9 9 9 9 9' twice
  # (overlapping): 5/6; row 2: '4 5 4' twice: 3/5; row 3: one token besides EOS: 0
  assert got["distinct_frac"] == pytest.approx(8 / 19)
  assert got["repeat_ngram_frac"] == pytest.approx(np.mean([0.0, 5 / 6, 3 / 5, 0.0]))
  bare = repetition_fields(np.full((4, 3), EOS), np.array([[1, 0, 0]] * 4, bool), (EOS,))
  assert bare == {"distinct_frac": 0.25, "repeat_ngram_frac": 0.0}  # a batch of bare EOS: 1 distinct in 4


def _feed(guard, loop, values, start=1):
  recs = []
  for step, (entropy, distinct) in enumerate(values, start):
    rec = {"step": step, "entropy": entropy, "distinct_frac": distinct, "repeat_ngram_frac": 1 - distinct}
    guard.record(loop, rec)
    loop.records.append(rec)
    recs.append(rec)
  return recs


@pytest.mark.parametrize("policy", ["warn", "halt"])
def test_the_collapse_guard_fires_when_entropy_and_distinct_share_both_fall_under_the_ratio(policy):
  guard, loop = CollapseGuard(policy, ratio=0.5, window=2), _loop()
  healthy = [(4.0, 0.8), (4.0, 0.8)]  # the reference window
  sharper = [(1.0, 0.8), (1.0, 0.8)]  # entropy down to 1/4, tokens as varied: a student growing sharp, not collapse
  repetitive = [(3.5, 0.2), (3.5, 0.2)]  # repetitive but not confident: not both
  collapsed = [(0.1, 0.05), (0.1, 0.05)]
  recs = _feed(guard, loop, healthy + sharper + repetitive + collapsed)
  assert not any("collapse_guard_event" in r for r in recs[:6])
  assert recs[3]["collapse_guard_entropy"] == pytest.approx(1.0)
  # step 7's window: one repetitive step and one collapsed, (3.5 + 0.1) / 2 < 0.5 * 4 and (0.2 + 0.05) / 2 < 0.5 * 0.8
  assert "collapse: entropy 1.8 (first 2 steps: 4) and distinct_frac 0.125" in recs[6]["collapse_guard_event"]
  if policy == "warn":
    assert loop.stop is None and recs[6]["collapse_guard_event"].endswith("(train.collapse_guard=warn)")
    more = _feed(guard, loop, collapsed * 2, start=9)  # still collapsed: warned once, not again
    assert not any("collapse_guard_event" in r for r in more)
    guard.end(loop)
  else:
    assert loop.stop == "collapse_guard"
    with pytest.raises(CollapseHalt, match=r"collapse guard: at step 7, entropy 1.8 .* halted\."):
      guard.end(loop)


def test_the_collapse_guard_reference_survives_a_checkpoint():
  before, loop = CollapseGuard("warn", 0.5, 2), _loop()
  _feed(before, loop, [(4.0, 0.8), (4.0, 0.8), (0.1, 0.05)])
  resumed = CollapseGuard("warn", 0.5, 2, state=json.loads(json.dumps(before.state())))
  fresh = CollapseGuard("warn", 0.5, 2)
  a, b = (_feed(g, loop, [(0.1, 0.05)], start=4)[0] for g in (resumed, fresh))
  assert "collapse_guard_event" in a and "collapse_guard_event" not in b  # fresh: that window is its reference


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["warn", "halt"])
def test_a_collapsing_demo_run_warns_and_halts_when_asked(demo_cache, tmp_path, capsys, policy):
  """The demo at learning rate 1.0 (200x its own) collapses within a few steps: every completion a bare EOS,
  entropy 0 (measured: steps 1-3 entropy 1.8-2.4, steps 4-30 entropy 0, held-out NLL on the teacher's answers
  1.53 -> 847). The guard warns and the run goes on, or halts, checkpointed."""
  from opdjax import cli

  out = tmp_path / "run"
  rc = cli.main(["train", "--config", "configs/demo.py", "--out", str(out), "--config.optim.learning_rate=1.0",
                 "--config.train.steps=7", "--config.train.eval_every=7", "--config.task.num_eval=16",
                 "--config.train.collapse_guard_window=2", f"--config.train.collapse_guard={policy}"])
  err = capsys.readouterr().err
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
  fired = [r for r in recs if "collapse_guard_event" in r]
  assert len(fired) == 1 and "collapse: entropy" in fired[0]["collapse_guard_event"], err
  assert fired[0]["collapse_guard_entropy"] < 0.5 * fired[0]["entropy"] or fired[0]["entropy"] < 0.1
  if policy == "warn":
    assert rc == 0 and recs[-1]["step"] == 7 and "collapse guard: collapse: entropy" in err
  else:
    assert rc == 2 and f"collapse guard: at step {fired[0]['step']}" in err and "halted" in err
    assert recs[-1]["step"] == fired[0]["step"] + 1 < 7  # the step in flight finishes, checkpointed
    assert (out / "checkpoints" / "latest" / str(recs[-1]["step"])).is_dir()
