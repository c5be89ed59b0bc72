"""Orbax checkpoints: exact resume after SIGKILL, refusals that overwrite nothing, NaN handling."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from opdjax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", "configs/demo.py", "--config.train.steps=8", "--config.train.checkpoint_every=2",
        "--config.train.eval_every=2", "--config.rollout.view=lag=1"]


def _records(out):
  return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _subprocess_train(out, fault=None):
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("OPDJAX_FAULT", None)
  if fault:
    env["OPDJAX_FAULT"] = fault
  return subprocess.run([sys.executable, "-m", "opdjax.cli", "train", "--out", str(out), *ARGS], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(demo_cache, tmp_path_factory):
  out = tmp_path_factory.mktemp("ref") / "run"
  assert cli.main(["train", "--out", str(out), *ARGS]) == 0
  return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["step@3", "save@4", "rollout@7"])
def test_sigkill_then_resume_is_bitwise_identical(reference, tmp_path, fault):
  out = tmp_path / "run"
  killed = _subprocess_train(out, fault)
  assert killed.returncode == -9, killed.stderr[-2000:]
  resumed = _subprocess_train(out)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  ref = open(reference / "student" / "model.safetensors", "rb").read()
  assert open(out / "student" / "model.safetensors", "rb").read() == ref
  got, want = _records(out), _records(reference)
  assert [r["step"] for r in got] == list(range(9))  # every step exactly once
  for a, b in zip(got, want):
    assert {k: v for k, v in a.items() if k != "elapsed_s"} == {k: v for k, v in b.items() if k != "elapsed_s"}


@pytest.mark.slow
def test_resume_refusals_and_fallback(reference, tmp_path, capsys):
  out = tmp_path / "run"
  shutil.copytree(reference, out)
  before = (out / "metrics.jsonl").read_text()
  # A different student shape: one clear error, nothing written.
  rc = cli.main(["train", "--out", str(out), *ARGS, "--config.student.hidden_size=48"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "different student model" in err and "hidden_size: 32 in the checkpoint, 48 now" in err
  assert (out / "metrics.jsonl").read_text() == before
  # Corrupt the newest checkpoint's arrays: the error names the step and path ...
  latest = out / "checkpoints" / "latest"
  for root, _, files in os.walk(latest / "8"):
    for f in files:
      if f not in ("_CHECKPOINT_METADATA",) and "meta" not in root:
        with open(os.path.join(root, f), "r+b") as fh:
          fh.truncate(max(os.path.getsize(os.path.join(root, f)) // 3, 1))
  rc = cli.main(["train", "--out", str(out), *ARGS[:1], ARGS[1], "--config.train.steps=10",
                 *ARGS[3:], "--config.train.checkpoint_every=2"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "checkpoint step 8" in err and str(latest / "8") in err
  # ... and --resume-fallback continues from step 6, re-running steps 7..10 once each.
  rc = cli.main(["train", "--out", str(out), "--resume-fallback", *ARGS[:2], "--config.train.steps=10", *ARGS[3:]])
  assert rc == 0
  assert [r["step"] for r in _records(out)] == list(range(11))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["halt", "skip"])
def test_nonfinite_loss(demo_cache, tmp_path, capsys, policy):
  out = tmp_path / policy
  rc = cli.main(["train", "--out", str(out), "--config", "configs/demo.py", "--config.train.steps=6",
                 "--config.train.checkpoint_every=1", "--config.optim.learning_rate=1e30",
                 "--config.optim.warmup_steps=1", f"--config.train.on_nonfinite={policy}"])
  recs = _records(out)
  if policy == "halt":
    assert rc == 2
    assert "non-finite loss" in capsys.readouterr().err
    bad = recs[-1]["step"]
    steps = sorted(int(s) for s in os.listdir(out / "checkpoints" / "latest") if s.isdigit())
    assert steps and max(steps) < bad  # the last checkpoint is from before the bad step
  else:
    assert rc == 0
    assert any(r.get("skipped") == 1.0 for r in recs[1:])
