"""Error paths of `opdjax train` that must leave nothing behind: start-up checks before the first
write in a new --out, and Ctrl-C reported in one line with where the same command resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import free_port

from opdjax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("url, says", [("http://127.0.0.1:CLOSED", "no vLLM server answers at"),
                                       ("127.0.0.1:8000", "is not a server's base URL"),
                                       ("http://127.0.0.1:8000/v1", "is not a server's base URL")])
def test_unreachable_or_malformed_vllm_url_writes_nothing(tmp_path, capsys, url, says):
  # A port bound then released: nothing listens there. Drawn at run time: the same test ids in every collection.
  url = url.replace("CLOSED", str(free_port()))
  out = tmp_path / "new"
  rc = cli.main(["train", "--config", "configs/demo.py", "--out", str(out), "--config.rollout.engine=vllm",
                 f"--config.rollout.vllm.url={url}"])
  err = capsys.readouterr().err
  assert rc == 2 and says in err, err
  assert len(err.strip().splitlines()) == 1, err
  assert not out.exists()


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_the_same_command_resumes(demo_cache, tmp_path):
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "opdjax.cli", "train", "--config", "configs/demo.py", "--out", str(out),
         # Far more steps than the wait needs (an idle box ran 400 demo steps before the signal landed).
         "--config.train.steps=20000", "--config.train.checkpoint_every=2", "--config.train.eval_every=50"]
  env = {**os.environ, "OPDJAX_CACHE": demo_cache}
  # The child starts with SIGINT at its default, so that Python installs its Ctrl-C handler: a pytest started in
  # the background (`pytest &`, nohup) passes SIGINT ignored down, and a run started that way rightly ignores it.
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  latest = out / "checkpoints" / "latest"
  deadline = time.time() + 240

  def saved() -> bool:
    return latest.is_dir() and any(d.isdigit() and int(d) >= 4 for d in os.listdir(latest))

  try:
    while time.time() < deadline and not saved():
      assert proc.poll() is None, proc.communicate()
      time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:  # the signal did not stop it: fail without leaving it running
      proc.kill()
      proc.communicate()
  assert proc.returncode == 130, err
  assert "Traceback" not in err, err
  last = err.strip().splitlines()[-1]
  assert last.startswith("opdjax: interrupted during step ") and "the same command resumes from step" in last, err
  resume_step = int(last.rsplit("step ", 1)[1].rstrip("."))
  done = sorted(int(d) for d in os.listdir(latest) if d.isdigit())
  assert resume_step == done[-1] >= 4  # every checkpoint the message counts on is complete
  rerun = subprocess.run([*cmd[:-3], "--config.train.steps=" + str(resume_step + 1), *cmd[-2:]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0 and f"resumed at step {resume_step}" in rerun.stdout, rerun.stderr


@pytest.fixture
def python_sigint():
  """Python's own Ctrl-C handler for the test (a pytest-xdist worker may have started with SIGINT ignored,
  depending on what ran before it in the same process), the worker's put back after."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_checkpoint_save_is_held_until_orbax_returns(tmp_path, python_sigint):
  """A SIGINT that lands inside Orbax's save or wait (the full suite's one failure: Orbax logged the
  interrupted thread join with a traceback) is raised only after Orbax returned, and the saves complete."""
  import jax.numpy as jnp
  import numpy as np

  from opdjax.pipeline.checkpoint import RunCheckpointer

  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=3)
  tree = {"w": jnp.arange(4.0)}
  ckpt.save(1, tree, {"step": 1})
  inner = ckpt._latest.wait_until_finished
  returned = []

  def interrupted_wait():  # the signal arrives while Orbax joins its save thread
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # a handler that raised would have done so by now, inside Orbax
    inner()
    returned.append(True)

  ckpt._latest.wait_until_finished = interrupted_wait
  with pytest.raises(KeyboardInterrupt):
    ckpt.save(2, tree, {"step": 2})
  assert returned == [True]  # Orbax's wait ran to its end; the interrupt came after it
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
  ckpt._latest.wait_until_finished = inner
  ckpt.close()
  assert ckpt.all_steps() == [1] and ckpt.incomplete() == []  # step 2 never started; step 1 complete
  state, meta = ckpt.restore(1, tree)
  np.testing.assert_array_equal(state["w"], tree["w"])
  assert meta == {"step": 1}


@pytest.mark.slow
def test_sigterm_checkpoints_the_last_finished_step(demo_cache, tmp_path):
  """SIGTERM (SLURM's preemption) with no checkpoint due for 1000 steps: the run checkpoints its last finished step
  before it exits, says so exactly, and the same command goes on with every step logged once."""
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "opdjax.cli", "train", "--config", "configs/demo.py", "--out", str(out),
         "--config.train.steps=20000", "--config.train.checkpoint_every=1000", "--config.train.eval_every=50"]
  env = {**os.environ, "OPDJAX_CACHE": demo_cache}
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = out / "metrics.jsonl"
  deadline = time.time() + 240
  try:
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
      assert proc.poll() is None, proc.communicate()
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  assert proc.returncode == 130 and "Traceback" not in err, err
  last = err.strip().splitlines()[-1]
  assert last.startswith("opdjax: interrupted (SIGTERM) during step "), err
  during = int(last.split("during step ")[1].split(",")[0])
  finished = int(last.split("after step ")[1].split(" ")[0])
  resume_step = int(last.rsplit("step ", 1)[1].rstrip("."))
  logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
  # Exact: the step it was in is the one after the last finished, whose record is written and checkpointed.
  assert during == finished + 1 and resume_step == finished == logged[-1] >= 3, (last, logged)
  assert sorted(int(d) for d in os.listdir(out / "checkpoints" / "latest") if d.isdigit()) == [finished]
  rerun = subprocess.run([*cmd[:-3], f"--config.train.steps={finished + 2}", *cmd[-2:]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0 and f"resumed at step {finished}" in rerun.stdout, rerun.stderr
  logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
  assert logged == list(range(finished + 3)), logged  # every step once, none lost, none twice
