"""The suite's own hooks: pytest without pytest-xdist (the GPU image has none) still runs."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_tests_are_skipped_not_an_internal_error_without_xdist():
  """`pytest -p no:xdist -o addopts="" tests/test_gpu.py`: the xdist hooks of conftest.py are optional
  (an unknown hook is an INTERNALERROR and no test runs), and on a machine without a GPU every test
  of the file is reported skipped with its reason."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-o", "addopts=", "-rs",
                         "tests/test_gpu.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "INTERNALERROR" not in out, out[-3000:]
  assert "5 skipped" in out and "needs a GPU (JAX sees none)" in out, out[-3000:]


def _run_with_the_suites_conftest(folder, test_file: str, source: str, env: dict, *args: str):
  """pytest (with `args`) on `folder`/`test_file` holding `source`, beside the suite's conftest and helpers;
  `env` on top of os.environ (a None value drops that variable). The inner run is its own session: this
  worker's PYTEST_XDIST_* variables are not passed on (an inner run once took itself for worker gw1)."""
  for name in ("conftest.py", "helpers.py"):
    (folder / name).symlink_to(os.path.join(ROOT, "tests", name))
  (folder / test_file).write_text(source)
  full = {k: v for k, v in {**os.environ, **env}.items() if v is not None and not k.startswith("PYTEST_XDIST_")}
  full["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
  return subprocess.run([sys.executable, "-m", "pytest", *args, "-o", "addopts=", "-p", "no:cacheprovider",
                         str(folder / test_file)], cwd=folder, env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a pytest run in a subprocess: 12 s in the fast tier on 2 cores
def test_pytest_workers_on_a_gpu_node_take_a_share_each_not_75_percent(tmp_path):
  """Two pytest-xdist workers with one (faked) GPU visible: each starts JAX unpreallocated with under
  half of the GPU. The suite's conftest, run on a one-test folder."""
  proc = _run_with_the_suites_conftest(
      tmp_path, "test_env.py",
      "import os\n"
      "def test_env():\n"
      "  assert os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'\n"
      "  assert os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.47'\n",
      {**dict.fromkeys(k for k in os.environ if k.startswith("XLA_PYTHON_CLIENT")), "JAX_PLATFORMS": "cpu",
       "CUDA_VISIBLE_DEVICES": "0"}, "-n", "2")
  assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_test_that_sets_environment_variables_leaks_none_to_the_next(tmp_path):
  """conftest's environment_restored: what one test (or a script it imports) puts in os.environ, changed or
  new, is gone at the next; the subprocesses of later tests inherit os.environ. The suite's conftest, run on a
  two-test file (JAX_NUM_CPU_DEVICES=2 leaked from an imported script once gave another file's subprocess 2
  host devices instead of 4)."""
  proc = _run_with_the_suites_conftest(
      tmp_path, "test_leak.py",
      "import os\n"
      "def test_sets():\n"
      "  os.environ['JAX_NUM_CPU_DEVICES'] = '2'\n"
      "  os.environ['OPDJAX_TEST_KNOB'] = 'changed'\n"
      "def test_sees_none():\n"
      "  assert 'JAX_NUM_CPU_DEVICES' not in os.environ and os.environ['OPDJAX_TEST_KNOB'] == 'kept'\n",
      {"JAX_NUM_CPU_DEVICES": None, "JAX_PLATFORMS": "cpu", "OPDJAX_TEST_KNOB": "kept"}, "-p", "no:xdist")
  assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.slow  # a pytest run in a subprocess
def test_a_profiled_run_writes_each_tests_wall_and_cpu(tmp_path):
  """OPDJAX_TEST_PROFILE=DIR: a line per test with its wall and CPU seconds, a subprocess's CPU among its
  children's (what the suite's time is made of on a CPU-bound box)."""
  out = tmp_path / "profile"
  (tmp_path / "t").mkdir()
  proc = _run_with_the_suites_conftest(
      tmp_path / "t", "test_two.py",
      "import subprocess, sys\n"
      "def test_idle():\n"
      "  pass\n"
      "def test_busy_child():\n"
      "  subprocess.run([sys.executable, '-c', 'sum(i * i for i in range(3_000_000))'], check=True)\n",
      {"OPDJAX_TEST_PROFILE": str(out), "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
  lines = {r["test"].split("::")[1]: r for r in map(json.loads, (out / "main.jsonl").read_text().splitlines())}
  assert set(lines) == {"test_idle", "test_busy_child"}
  assert lines["test_busy_child"]["children_cpu_s"] > 0.05 > lines["test_idle"]["children_cpu_s"]
  assert all(r["wall_s"] >= 0 and r["self_cpu_s"] >= 0 for r in lines.values())
