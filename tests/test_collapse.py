"""The collapse guard (opdjax.pipeline.telemetry.CollapseGuardHook) and the repetition fields it reads
(opdjax.pipeline.lengths.repetition_fields); the run-level test is a high learning rate on the demo."""

import json

import numpy as np
import pytest

from opdjax.pipeline.lengths import repetition_fields
from opdjax.pipeline.loop import Loop
from opdjax.pipeline.telemetry import CollapseGuardHook, CollapseHalt

EOS = 2


def _loop():
  return Loop(session=None, view=None, seed=0, steps=50, state=None, sampler=None, hooks=[])


def test_repetition_fields_of_varied_and_collapsed_completions():
  toks = np.array([[5, 6, 7, 8, EOS, 0], [9] * 6, [4, 5, 4, 5, 4, EOS], [3, EOS, 0, 0, 0, 0]])
  mask = np.array([[1] * 5 + [0], [1] * 6, [1] * 6, [1, 1, 0, 0, 0, 0]], bool)
  got = repetition_fields(toks, mask, (EOS,))
  # row 0: 4 distinct of 4, nothing repeated; row 1: 1 of 6, '9 9 9 9 9' twice (overlapping): 5/6;
  # row 2: 2 of 5, '4 5 4' twice: 3/5; row 3: one token, left out
  assert got["distinct_frac"] == pytest.approx(np.mean([1.0, 1 / 6, 2 / 5]))
  assert got["repeat_ngram_frac"] == pytest.approx(np.mean([0.0, 5 / 6, 3 / 5]))


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
  guard, loop = CollapseGuardHook(policy, ratio=0.5, window=2), _loop()
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
  before, loop = CollapseGuardHook("warn", 0.5, 2), _loop()
  _feed(before, loop, [(4.0, 0.8), (4.0, 0.8), (0.1, 0.05)])
  resumed = CollapseGuardHook("warn", 0.5, 2, state=json.loads(json.dumps(before.state())))
  fresh = CollapseGuardHook("warn", 0.5, 2)
  a, b = (_feed(g, loop, [(0.1, 0.05)], start=4)[0] for g in (resumed, fresh))
  assert "collapse_guard_event" in a and "collapse_guard_event" not in b  # fresh: that window is its reference
