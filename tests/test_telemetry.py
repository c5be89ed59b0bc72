"""Completion-length fields, the length guard, train.loggers' checks and the bad inputs of issue 45 that need
no run (the end-to-end runs are in tests/test_users_run.py)."""

import os

import numpy as np
import pytest

from opdjax import cli
from opdjax.config.defaults import default_config
from opdjax.config.loader import apply_overrides
from opdjax.config.schema import build
from opdjax.errors import UserError
from opdjax.pipeline.guards import LengthGuard, LengthHalt
from opdjax.pipeline.loop import Loop
from opdjax.pipeline.writers import trackers
from opdjax.rollout.base import length_fields

EOS = 1


def test_length_fields_count_truncation_and_eos_per_row():
  toks = np.array([[5, 6, EOS, 0], [5, 6, 7, 8], [5, 6, 7, EOS], [5, 0, 0, 0]])
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], bool)
  got = length_fields(toks, mask, max_new_tokens=4, eos_ids=(EOS,))
  # row 0 ends on EOS early, row 1 hits the cap without EOS (truncated), row 2 hits the cap on EOS (not
  # truncated), row 3 stopped early without EOS (e.g. a stop string): neither
  assert got == {"completion_len_mean": 3.0, "completion_len_max": 4, "truncated_frac": 0.25, "eos_frac": 0.5}


def _loop(steps=20):
  return Loop(session=None, view=None, seed=0, steps=steps, state=None, sampler=None, hooks=[])


@pytest.mark.parametrize("policy", ["warn", "halt"])
def test_the_length_guard_acts_on_the_window_mean_only_above_its_threshold(policy):
  guard, loop = LengthGuard(policy, threshold=0.5, window=3), _loop()
  shares = [0.4, 0.6, 0.5, 0.5, 0.9, 0.8, 0.9, 0.7, 0.8]  # windows: 0.5 (not above), 0.53, ..., 0.87, 0.8
  recs = []
  for step, share in enumerate(shares, 1):
    rec = {"step": step, "truncated_frac": share}
    guard.record(loop, rec)
    loop.records.append(rec)
    recs.append(rec)
  assert "length_guard_event" not in recs[2] and recs[2]["length_guard_truncated"] == pytest.approx(0.5)
  assert "length_guard_event" in recs[3]  # (0.6 + 0.5 + 0.5) / 3 > 0.5
  assert "length_guard_event" not in recs[4]  # a fresh window after an event
  if policy == "warn":
    assert loop.stop is None and "train.length_guard=warn" in recs[3]["length_guard_event"]
    # still over at the next full window (step 7): warned once already, not again until it comes back down
    assert recs[6]["length_guard_truncated"] > 0.5 and "length_guard_event" not in recs[6]
    guard.end(loop)
  else:
    assert loop.stop == "length_guard"
    with pytest.raises(LengthHalt, match=r"length guard: at step 4, 53% of the last 3 steps' completions hit"):
      guard.end(loop)


@pytest.mark.parametrize("key, value, match", [
    ("train.loggers", "jsonl,mlflow", r"'mlflow' is not a logger; choose from jsonl, tensorboard, wandb, trackio"),
    ("train.log_samples_every", "2000", r"larger than the run \(train.steps=1200\)"),
    ("train.length_guard", "stop", "choose one of 'off', 'warn', 'halt'"),
    ("train.tensorboard", "true", r"train.tensorboard is gone: .* train.loggers=jsonl,tensorboard"),
])
def test_bad_telemetry_config_is_one_line(key, value, match):
  with pytest.raises(UserError, match=match) as e:
    build(apply_overrides(default_config(), {key: value}))
  assert "\n" not in str(e.value)


def test_a_gone_key_is_refused_in_a_config_file_and_left_out_of_a_resume_s_comparison():
  from opdjax.config.schema import Config
  from opdjax.pipeline.run import config_changes

  cfg = default_config().to_dict()
  cfg["train"]["tensorboard"] = True
  with pytest.raises(UserError, match=r"^train.tensorboard is gone: .*train.loggers=jsonl,tensorboard"):
    build(cfg)
  old = Config().to_dict()
  old["train"]["tensorboard"] = True  # an older run's config.json
  assert config_changes(old, Config().to_dict()) == ({}, {})


def test_a_tracker_not_installed_is_one_line_naming_the_extra_before_out_is_written(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(trackers.PACKAGES, "trackio", "opdjax_no_such_tracker_package")
  out = tmp_path / "run"
  rc = cli.main(["train", "--config", "configs/demo.py", "--out", str(out), "--config.train.loggers=jsonl,trackio"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1
  assert "pip install 'opdjax[trackers]'" in err and "'trackio'" in err
  assert not os.path.exists(out)


def test_the_source_commit_is_this_checkout_s():
  import subprocess

  head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if head.returncode:
    pytest.skip("not a git checkout")
  assert trackers.source_commit().split("+")[0] == head.stdout.strip()


def test_the_length_guard_window_survives_a_checkpoint():
  """A resumed run's guard continues the window the checkpoint kept (as the uninterrupted run's would)."""
  import json

  before, loop = LengthGuard("warn", threshold=0.5, window=3), _loop()
  for step in (1, 2):
    before.record(loop, {"step": step, "truncated_frac": 0.9})
  resumed, fresh = (LengthGuard("warn", 0.5, 3, state=s) for s in (json.loads(json.dumps(before.state())), None))
  a, b = {"step": 3, "truncated_frac": 0.9}, {"step": 3, "truncated_frac": 0.9}
  resumed.record(loop, a)
  fresh.record(loop, b)
  assert "length_guard_event" in a and "length_guard_truncated" not in b
