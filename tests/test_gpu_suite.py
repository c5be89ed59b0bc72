"""The prepared GPU suite (bench/gpu_suite.sh), checked without a GPU: its dry run lowers every part
at full size within 3 minutes and reports every field, with nothing that needs ml_collections."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _without_ml_collections(tmp_path) -> dict:
  """An environment whose Python cannot import ml_collections (the H200 image has none)."""
  (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['ml_collections'] = None\n")
  path = os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])
  return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}


def test_gpu_suite_imports_nothing_that_needs_ml_collections(tmp_path):
  code = ("import sys; sys.path.insert(0, 'bench'); import importlib, gpu_suite\n"
          "for m in gpu_suite.SUITE_MODULES: importlib.import_module(m)\n"
          "import ml_collections\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_without_ml_collections(tmp_path),
                        capture_output=True, text=True, timeout=120)
  # The last import fails: the block is in place, and everything before it imported.
  assert proc.returncode == 1 and "import of ml_collections halted" in proc.stderr, proc.stderr[-2000:]


def _keys(tree, prefix=()) -> set[tuple]:
  out = {prefix}
  if isinstance(tree, dict):
    for k, v in tree.items():
      out |= _keys(v, prefix + (k,))
  return out


@pytest.mark.slow
def test_gpu_suite_dry_run_traces_every_part_at_full_size(tmp_path):
  """`bash bench/gpu_suite.sh --dry-run`, without ml_collections: every part lowers at the GPU shapes
  on this CPU within 3 minutes, and the JSON has every field, measurements null."""
  import importlib.util

  env = {**_without_ml_collections(tmp_path), "OUT": str(tmp_path / "out")}
  proc = subprocess.run(["bash", "bench/gpu_suite.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(tmp_path / "out" / "gpu_suite_dry_run.json") as f:
    rep = json.load(f)
  assert '"dry_run": true' in proc.stdout and "## GPU suite (dry run" in proc.stdout

  spec = importlib.util.spec_from_file_location("gpu_suite_under_test", os.path.join(ROOT, "bench", "gpu_suite.py"))
  suite = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(suite)
  assert _keys(rep) == _keys(suite.empty_report(True, "full"))
  assert rep["wall_s"] < 180, rep["wall_s"]
  assert all(p["status"] == "ok" for p in rep["parts"].values()), rep["parts"]
  assert all(v is None for v in rep["targets"].values()) and all(v is None for v in rep["compile_s"].values())
  assert rep["opd_step"]["opdjax"]["tokens_per_s"] is None and rep["rollout"]["speedup"] is None
  assert all(v > 0 for v in rep["trace_s"].values()), rep["trace_s"]
  # Full size: Qwen3-0.6B on both sides, ~9 GFLOP per token, FP8 dots in the W8A8 engine only.
  o, t = rep["opd_step"]["opdjax"], rep["opd_step"]["pytorch"]
  assert o["params"] == t["params"] == rep["rollout"]["hf_generate"]["params"] == 596_049_920
  assert 8e9 < o["flops_per_step"] / (8 * 1024) < 10e9, o["flops_per_step"]
  assert rep["engine_decode"]["fp8_w8a8"]["fp8_dots_in_program"] == 14  # 7 projections, prefill and decode
  assert rep["engine_decode"]["fp8_weight_only"]["fp8_dots_in_program"] == 0
