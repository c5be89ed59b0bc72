"""A real two-node SLURM cluster (scripts/slurm_cluster.py: a controller and nodes n1, n2, each a network +
UTS + mount namespace with its own host name) running launch/slurm_multinode.sh submitted unchanged with
`sbatch`, as a cluster user does: one `opdjax train` process a node under `srun`, jax.distributed initialized
from SLURM's environment.

- 2 nodes x 1 process equal 1 process x 2 devices (the same mesh, data=2) within the scale-out tolerance
  (1e-5 relative), every step once in metrics.jsonl.
- One run stopped by `scancel` (nothing left on either node), resumed with the same script, then stopped by a
  lost node (SIGKILL to every process in n2's namespaces, slurmd included, at a random step): the survivor
  stops within a bounded time with one line naming n2, nothing of the job is left on n1, and `sbatch` of the
  same script (once n2 is back) resumes: every step once, losses bitwise the uninterrupted run's (a
  synchronous run's resume is exact).
- Each host's first process starts that host's served teacher (teacher.vllm.per_host): a server in each
  node's namespaces, none reachable from the other host; a sidecar bound beyond loopback answers the other
  host 401 without the job's token.
- Last: the cluster goes down and nothing of it remains (process, namespace, vLLM server).

One cluster for the file (module fixture), started in 1-2 s; the file is its own xdist unit (conftest.UNITS).
"""

import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from opdjax.models import Model
from opdjax.models.hf_io import save_hf_params
from opdjax.rollout.vllm.server import SERVER_MODULE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "scripts", "slurm_cluster.py")
STEPS = 6  # room for a scancel and a lost node in one run (test_scancel_then_a_lost_node_...)
LOST_NODE_STOP_S = 60  # the survivor's bound: the watchdog sees the dead peer's connection close at once


SBATCH = ("sbatch", "--no-requeue", "--nodes=2")  # the recipe's: SLURM would requeue a job that lost a node
SCRIPT = ("launch/slurm_multinode.sh", "configs/demo.py")
PER_HOST_TEACHER = ("--config.teacher.serve=vllm", "--config.teacher.vllm.per_host=true",
                    "--config.teacher.vllm.dtype=float32")
RECIPE_MARK = ("<!-- tests/test_slurm.py:recipe -->", "<!-- /tests/test_slurm.py:recipe -->")


def recipe() -> str:
  """docs/scaling.md's cluster recipe: the job the per-host teacher test submits, its folders named for a user."""
  import shlex

  files = "/models"
  args = [a.replace("{files}", files) for a in _args("{files}", PER_HOST_TEACHER)]
  line = shlex.join([*SBATCH, *SCRIPT, "runs/opd", *args]).replace(" --config", " \\\n    --config")
  return "\n".join([
      "# On the login node, in the repository (installed in its .venv as the README says). CPU nodes, as the",
      "# test's: GPUS_PER_NODE=1 JAX_NUM_CPU_DEVICES=1 in the environment (sbatch passes it on).",
      line,
      "# Each node: one trainer process (srun), jax.distributed joined at the first node; with",
      "# teacher.vllm.per_host, each node's first process starts that node's teacher server on its loopback.",
      "# A lost node or a scancel: once `sinfo` shows the nodes idle, the same line resumes from the last",
      "# complete checkpoint (every step logged once).",
  ])


class Cluster:
  def __init__(self, d):
    self.dir = str(d)
    self.env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "1", "GPUS_PER_NODE": "1",
                "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    self.env.pop("OPDJAX_SIDECAR_TOKEN", None)

  def script(self, *args, check=True, env=None, timeout=900) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, CLUSTER, *args], cwd=ROOT, env=env or self.env, capture_output=True,
                       text=True, timeout=timeout)
    assert not check or p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p

  def run(self, host, *cmd, **kw) -> subprocess.CompletedProcess:
    return self.script("run", self.dir, host, "--", *cmd, **kw)

  def state(self) -> dict:
    with open(os.path.join(self.dir, "cluster.json")) as f:
      return json.load(f)

  def sbatch(self, out, *extra, wait=True, env=None) -> tuple[str, subprocess.CompletedProcess]:
    """launch/slurm_multinode.sh on both nodes, as a user submits it (the job's id, sbatch's result)."""
    plumbing = ["--parsable", f"--output={self.dir}/job-%j.out", *(["--wait"] if wait else [])]  # the test's
    p = self.run("ctl", *SBATCH, *plumbing, *SCRIPT, str(out), *extra, check=False, env=env)
    job = p.stdout.strip().splitlines()[0].split(";")[0] if p.stdout.strip() else ""
    assert job.isdigit(), p.stdout + p.stderr
    return job, p

  def output(self, job) -> str:
    path = os.path.join(self.dir, f"job-{job}.out")
    return open(path).read() if os.path.exists(path) else ""

  def job_state(self, job) -> str:
    return self.run("ctl", "squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()

  def processes(self, host) -> list[str]:
    """The command lines of `host`'s processes (its namespace holder excluded)."""
    sc = _script_module()
    holder = self.state()["holders"][host]
    return [sc._cmdline(p, None) for p in sc.members(holder)]


def _script_module():
  import importlib.util

  spec = importlib.util.spec_from_file_location("slurm_cluster", CLUSTER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  d = tmp_path_factory.mktemp("slurm")
  venv = os.path.join(ROOT, ".venv")  # the script activates SLURM_SUBMIT_DIR/.venv, as a cluster install has
  linked = not os.path.exists(venv)
  if linked:
    os.symlink(sys.prefix, venv)
  c = Cluster(d)
  p = c.script("up", c.dir, check=False)
  if p.returncode == 77:  # the one reason to skip: the machine forbids namespaces (or root)
    pytest.skip(p.stdout.strip())
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  yield c
  if os.path.exists(os.path.join(c.dir, "cluster.json")):
    c.script("down", c.dir)
  if linked:
    os.remove(venv)


@pytest.fixture(scope="module")
def files(tmp_path_factory, random_params):
  from test_async_multi import MODEL

  d = tmp_path_factory.mktemp("slurm-files")
  model = Model(MODEL)
  save_hf_params(random_params(model, seed=0, std=0.3), MODEL, str(d / "teacher"))
  save_hf_params(random_params(model, seed=1, std=0.3), MODEL, str(d / "student"))
  return d


def _args(files, extra=()) -> list[str]:
  return [f"--config.teacher.path={files}/teacher", f"--config.student.path={files}/student",
          "--config.loss.kind=sampled_rkl", "--config.loss.baseline=loo", f"--config.train.steps={STEPS}",
          "--config.rollout.batch_size=8", "--config.task.num_eval=8", "--config.train.eval_every=1000",
          "--config.train.checkpoint_every=1", *extra]


def _losses(out) -> dict[int, list[float]]:
  """step -> the losses logged for it (every step once: one each)."""
  steps = {}
  for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))):
    if "loss" in r:
      steps.setdefault(r["step"], []).append(r["loss"])
  return steps


def _once(out) -> list[float]:
  steps = _losses(out)
  assert sorted(steps) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in steps.values()), steps
  return [steps[s][0] for s in sorted(steps)]


@pytest.fixture(scope="module")
def two_nodes(cluster, files, tmp_path_factory):
  """The uninterrupted 2-node run: (its losses, the job's output)."""
  out = tmp_path_factory.mktemp("two-nodes") / "run"
  job, p = cluster.sbatch(out, *_args(files))
  text = cluster.output(job)
  assert p.returncode == 0, p.stderr + text[-4000:]
  return _once(out), text, job


def _wait_for_step(cluster, job, out, step: int, timeout_s: float = 600) -> None:
  deadline = time.time() + timeout_s
  while not (os.path.exists(os.path.join(out, "metrics.jsonl")) and max(_losses(out), default=0) >= step):
    assert time.time() < deadline and cluster.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), \
      cluster.output(job)[-4000:]
    time.sleep(0.2)


def _checkpoints(out) -> list[int]:
  latest = os.path.join(out, "checkpoints", "latest")
  return sorted(int(d) for d in os.listdir(latest) if d.isdigit()) if os.path.isdir(latest) else []


@pytest.mark.slow
def test_two_nodes_equal_one_process(cluster, two_nodes, one_process):
  two, text, job = two_nodes
  assert "over 2 devices (2 process(es) x 1 cpu)" in text, text[-3000:]  # really two processes
  for node in ("n1", "n2"):  # one task of the job's trainer step on each node
    with open(os.path.join(cluster.dir, f"slurmd-{node}.log")) as f:
      assert f"launch task StepId={job}.0 " in f.read(), node
  one = one_process
  assert max(abs(x) for x in one) > 1e-3
  print(f"2 nodes vs 1 process: max relative loss difference {max(abs(b / a - 1) for a, b in zip(one, two)):.2e}")
  np.testing.assert_allclose(two, one, rtol=1e-5)


@pytest.mark.slow
def test_scancel_then_a_lost_node_then_sbatch_resumes_bitwise(cluster, files, two_nodes, tmp_path):
  """One run stopped twice, then finished (one test: each 2-node start costs the suite ~25 s).
  1. `scancel` after the first logged step: a clean stop, nothing of the job left on either node.
  2. The same script again resumes; n2 loses every process (slurmd too) at a random moment after a step the
     resumed job logged: the survivor stops within LOST_NODE_STOP_S with one line naming n2, nothing left on n1.
  3. Once n2 is back, the same script resumes to the end: every step once, bitwise the uninterrupted run."""
  out = tmp_path / "run"
  job, _ = cluster.sbatch(out, *_args(files), wait=False)
  _wait_for_step(cluster, job, out, 1)
  cluster.run("ctl", "scancel", job)
  _job_end(cluster, job, timeout_s=120)
  assert not cluster.job_state(job), "the job outlived scancel by 120 s"
  for node in ("n1", "n2"):
    assert [c for c in cluster.processes(node) if "slurmd" not in c] == [], node
  assert "CANCELLED" in cluster.output(job), cluster.output(job)[-3000:]
  done = max(_losses(out))
  # Killed with at least 2 steps, the final save and the export still to run (at step STEPS - 2 with a delay up
  # to 1.5 s, the 2026-12-06 suite's run had finished before n2 went: no error line to wait for).
  assert done <= STEPS - 4, f"scancel after step 1 stopped the job only after step {done}: raise STEPS"
  seed = random.randrange(1 << 16)
  rng = random.Random(seed)
  at, delay = rng.randint(done + 1, STEPS - 3), rng.uniform(0, 0.5)
  print(f"scancel after step {done}; lost node: seed {seed}, n2 killed {delay:.2f} s after step {at} is logged")
  job, _ = cluster.sbatch(out, *_args(files), wait=False)
  _wait_for_step(cluster, job, out, at)
  time.sleep(delay)
  t0 = time.time()
  cluster.script("kill", cluster.dir, "n2")
  while "opdjax: error:" not in cluster.output(job) and time.time() - t0 < LOST_NODE_STOP_S + 30:
    time.sleep(0.2)
  stopped = time.time() - t0
  _job_end(cluster, job, timeout_s=120)
  text = cluster.output(job)
  errors = [line for line in text.splitlines() if line.startswith("opdjax: error:")]
  print(f"the survivor stopped {stopped:.1f} s after n2 was lost: {errors}")
  assert stopped < LOST_NODE_STOP_S, text[-3000:]
  assert len(errors) == 1 and " on host n2 stopped" in errors[0], text[-3000:]  # one line, naming the lost host
  assert "Traceback" not in text, text[-3000:]
  assert [c for c in cluster.processes("n1") if "slurmd" not in c] == []  # nothing of the job left on n1
  assert cluster.processes("n2") == []
  kept = _checkpoints(out)
  cluster.script("boot", cluster.dir, "n2")  # the node is back
  job, p = cluster.sbatch(out, *_args(files))
  assert p.returncode == 0, cluster.output(job)[-4000:]
  if kept:  # else no checkpoint had completed: the resume starts over, as it should
    assert f"resumed at step {kept[-1]}, ran to step {STEPS}" in cluster.output(job), cluster.output(job)[-3000:]
  assert _once(out) == two_nodes[0]  # bitwise the uninterrupted run's


@pytest.fixture(scope="module")
def one_process(cluster, files, tmp_path_factory):
  """The same run in one process x 2 devices on this machine (mesh data=2, as the script gives 2 nodes)."""
  out = tmp_path_factory.mktemp("one-process") / "run"
  env = {**cluster.env, "JAX_NUM_CPU_DEVICES": "2"}
  p = subprocess.run([sys.executable, "-m", "opdjax.cli", "train", "--config", "configs/demo.py", "--out", str(out),
                      *_args(files, ["--config.mesh.data=2"])], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  return _once(out)


@pytest.mark.slow
@pytest.mark.vllm
def test_each_hosts_first_process_serves_its_hosts_teacher(cluster, files, one_process, tmp_path):
  """teacher.vllm.per_host: n1's and n2's trainer processes each start a teacher server in their own node,
  bound to that node's loopback (so each host's processes can only score against their own host's), and the
  run's losses equal the one-process run's with the teacher in the trainer within the served teacher's
  tolerance (1e-4, tests/test_served_teacher.py). No server outlives the job."""
  out = tmp_path / "run"
  job, _ = cluster.sbatch(out, *_args(files, PER_HOST_TEACHER), wait=False)
  _wait_for_step(cluster, job, out, 1, timeout_s=900)
  servers = {node: [c for c in cluster.processes(node) if SERVER_MODULE in c] for node in ("n1", "n2")}
  assert _job_end(cluster, job) == "COMPLETED", cluster.output(job)[-4000:]
  for node, cmds in servers.items():
    assert cmds, (node, cluster.output(job)[-3000:])  # a teacher server on each node, while the job ran
    assert all(" --host 127.0.0.1 " in c for c in cmds), cmds  # its node's loopback: host-local by construction
    assert os.path.exists(out / f"vllm-teacher-{node}.log"), sorted(os.listdir(out))
    assert [c for c in cluster.processes(node) if "slurmd" not in c] == [], node  # none outlived the job
  served = _once(out)
  worst = max(abs(b / a - 1) for a, b in zip(one_process, served))
  print(f"per-host served teachers on 2 nodes vs the trainer's teacher in 1 process: max relative loss difference"
        f" {worst:.2e}")
  np.testing.assert_allclose(served, one_process, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_sidecar_beyond_loopback_answers_another_host_401_without_the_token(cluster, files, tmp_path):
  """The sidecar command launch/slurm_multinode.sh runs on a node (`opdjax launch sidecar`, bound 0.0.0.0),
  started with srun on n2: from n1, a request without the job's token gets 401, with it 200."""
  import secrets
  import shlex

  token = secrets.token_urlsafe(32)
  env = {**cluster.env, "OPDJAX_SIDECAR_TOKEN": token, "VLLM_CPU_KVCACHE_SPACE": "1"}
  line = subprocess.run([sys.executable, "-m", "opdjax.cli", "launch", "sidecar", "--config", "configs/demo.py",
                         "--model", str(files / "student"), "--port", "8100", "--out", str(tmp_path),
                         "--config.rollout.batch_size=8", "--config.task.num_eval=8"], cwd=ROOT, env=env,
                        capture_output=True, text=True, check=True).stdout
  srun = subprocess.Popen([sys.executable, CLUSTER, "run", cluster.dir, "ctl", "--", "srun", "-N1", "-w", "n2",
                           "-J", "sidecar", *shlex.split(line)], cwd=ROOT, env=env,
                          stdout=open(tmp_path / "srun.log", "w"), stderr=subprocess.STDOUT)
  try:
    def status(node, auth=True):
      header = ["-H", f"Authorization: Bearer {token}"] if auth else []
      return cluster.run(node, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *header,
                         "http://n2:8100/health", check=False).stdout.strip()

    deadline = time.time() + 600
    while status("n1") != "200":
      assert srun.poll() is None and time.time() < deadline, (tmp_path / "srun.log").read_text()[-3000:]
      time.sleep(1)
    assert status("n1", auth=False) == "401"  # across hosts, without the token
    assert status("n2", auth=False) == "401"  # and on the sidecar's own node
  finally:
    cluster.run("ctl", "scancel", "-n", "sidecar", check=False)
    srun.wait(timeout=60)
  deadline = time.time() + 60
  while [c for c in cluster.processes("n2") if SERVER_MODULE in c] and time.time() < deadline:
    time.sleep(0.5)
  assert not [c for c in cluster.processes("n2") if SERVER_MODULE in c]  # scancel stopped the sidecar


def _job_end(cluster, job, timeout_s: float = 900) -> str:
  """The job's final state (COMPLETED, FAILED, CANCELLED, NODE_FAIL ...), once it left the queue."""
  deadline = time.time() + timeout_s
  while cluster.job_state(job) and time.time() < deadline:
    time.sleep(0.5)
  shown = cluster.run("ctl", "scontrol", "-o", "show", "job", job, check=False).stdout
  return next((w.split("=", 1)[1] for w in shown.split() if w.startswith("JobState=")), shown)


@pytest.mark.slow
def test_zz_nothing_of_the_cluster_remains(cluster):
  """Last in the file: the cluster goes down and nothing of it remains, no vLLM server anywhere either."""
  sc = _script_module()
  holders = cluster.state()["holders"]
  nets = {sc._ns(h) for h in holders.values()}
  assert None not in nets and len(nets) == len(holders)  # it was up: the check below could fail
  cluster.script("down", cluster.dir)
  left = [p for p in os.listdir("/proc") if p.isdigit() and sc._ns(p) in nets]
  assert left == [], [sc._cmdline(int(p)) for p in left]
  assert not os.path.exists(os.path.join(cluster.dir, "cluster.json"))
  mine = [p for p in os.listdir("/proc") if p.isdigit() and cluster.dir in sc._cmdline(int(p))
          and any(name in sc._cmdline(int(p)) for name in ("slurmd", "slurmctld", "munged", SERVER_MODULE))]
  assert mine == [], [sc._cmdline(int(p)) for p in mine]


def test_the_docs_recipe_is_the_tests_job():
  """docs/scaling.md shows the job the per-host teacher test submits (`recipe()`), not a copy that drifts."""
  text = open(os.path.join(ROOT, "docs", "scaling.md")).read()
  start, end = (text.index(m) for m in RECIPE_MARK)
  block = text[start + len(RECIPE_MARK[0]):end].strip()
  want = f"```bash\n{recipe()}\n```"
  assert block == want, f"docs/scaling.md's recipe differs from tests/test_slurm.py's recipe(); paste:\n{want}"
