"""The suite's own hooks: pytest without pytest-xdist (the GPU image has none) still runs."""

import os
import subprocess
import sys

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
