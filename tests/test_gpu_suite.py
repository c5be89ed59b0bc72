"""The prepared GPU suite (bench/gpu_suite.sh), checked without a GPU: its dry run lowers every part
at full size and reports every field, with nothing that needs ml_collections. How long that takes
(under 3 minutes, the suite's own budget) is bench/'s to report, not this test's."""

import json
import os
import subprocess
import sys
import types

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


def test_gpu_suite_sh_study_runs_the_reproduce_gpu_profile(tmp_path):
  """`--study`: scripts/reproduce.py's GPU profile, with ml_collections installed from bench/wheels/ where the
  image lacks it (and one clear error when there are no wheels to install)."""
  env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
  proc = subprocess.run(["bash", "bench/gpu_suite.sh", "--study", "--help"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0 and "--profile {cpu,gpu}" in proc.stdout, proc.stderr[-2000:]
  if os.path.isdir(os.path.join(ROOT, "bench", "wheels")) and os.listdir(os.path.join(ROOT, "bench", "wheels")):
    return  # wheels present: the script would install them, not refuse
  proc = subprocess.run(["bash", "bench/gpu_suite.sh", "--study", "--quick"], cwd=ROOT,
                        env={**_without_ml_collections(tmp_path), "PYTHON": sys.executable, "OUT": str(tmp_path)},
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and "--fetch-wheels" in proc.stderr and not (tmp_path / "repro-smollm2-gpu").exists()


def _unbudgeted_python(tmp_path) -> str:
  """A `python` for gpu_suite.sh (it runs "${PYTHON:-python}" bench/gpu_suite.py) whose suite gives every
  part an hour: on a loaded box the 170 s budget would stop a part that is merely slow, not broken."""
  (tmp_path / "unbudgeted.py").write_text(
      "import sys\n"
      "sys.path.insert(0, 'bench')\n"
      "import gpu_suite\n"
      "gpu_suite.DRY_BUDGET_S = 4 * 3600\n"
      "gpu_suite.PART_LIMITS_S = dict.fromkeys(gpu_suite.PART_LIMITS_S, 3600)\n"
      "sys.argv = sys.argv[1:]\n"
      "sys.exit(gpu_suite.main())\n")
  wrapper = tmp_path / "python"
  wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "unbudgeted.py"}" "$@"\n')
  wrapper.chmod(0o755)
  return str(wrapper)


def _keys(tree, prefix=()) -> set[tuple]:
  out = {prefix}
  if isinstance(tree, dict):
    for k, v in tree.items():
      out |= _keys(v, prefix + (k,))
  return out


@pytest.mark.slow
def test_gpu_suite_dry_run_traces_every_part_at_full_size(tmp_path):
  """`bash bench/gpu_suite.sh --dry-run`, without ml_collections: every part lowers at the GPU shapes
  on this CPU, and the JSON has every field, measurements null."""
  import importlib.util

  # PYTHON names the interpreter and the venv's bin is off PATH: nothing may run an `opdjax` executable or
  # a bare `python` (the GPU image has neither).
  venv_bin = os.path.dirname(sys.executable)
  path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
  env = {**_without_ml_collections(tmp_path), "OUT": str(tmp_path / "out"), "PYTHON": _unbudgeted_python(tmp_path),
         "PATH": path}
  proc = subprocess.run(["bash", "bench/gpu_suite.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=3600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(tmp_path / "out" / "gpu_suite_dry_run.json") as f:
    rep = json.load(f)
  assert '"dry_run": true' in proc.stdout and "## GPU suite (dry run" in proc.stdout

  spec = importlib.util.spec_from_file_location("gpu_suite_under_test", os.path.join(ROOT, "bench", "gpu_suite.py"))
  suite = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(suite)
  lowered = ("decode_steps", "lowered")  # a dict per planned program, filled by the run
  assert {k for k in _keys(rep) if k[:2] != lowered} == {k for k in _keys(suite.empty_report(True, "full"))
                                                           if k[:2] != lowered}
  assert rep["budget_s"] == 4 * 3600 and rep["wall_s"] > 0  # the run took the wrapper's budget, and timed itself
  assert all(p["status"] == "ok" for p in rep["parts"].values()), rep["parts"]
  assert all(v is None for v in rep["targets"].values()) and all(v is None for v in rep["compile_s"].values())
  assert rep["opd_step"]["opdjax"]["tokens_per_s"] is None and rep["rollout"]["speedup"] is None
  assert all(v > 0 for v in rep["trace_s"].values()), rep["trace_s"]
  # Full size: Qwen3-0.6B on both sides, ~9 GFLOP per token, FP8 dots in the W8A8 engine only.
  o, t = rep["opd_step"]["opdjax"], rep["opd_step"]["pytorch"]
  assert o["params"] == t["params"] == rep["rollout"]["hf_generate"]["params"] == 596_049_920
  assert 8e9 < o["flops_per_step"] / (8 * 1024) < 10e9, o["flops_per_step"]
  # 4 fused projections in each of the 28 layers, prefill and decode; W8A16 upcasts its fp8 inside the dot.
  assert rep["engine_decode"]["fp8_w8a8"]["fp8_dots_in_program"] == 4 * 28 * 2
  assert rep["engine_decode"]["fp8_weight_only"]["fp8_dots_in_program"] == 0
  # The decode part lowered every planned (variant, batch) program at full size, the floor's bytes beside.
  d = rep["decode_steps"]
  assert sorted(d["lowered"]) == sorted(d["plan"]) and len(d["plan"]) == 9 and d["rows"] == []
  assert d["plan"][:3] == ["bf16@64", "fp8_kv_w8a16@64", "bf16@256"]  # the target rows first
  assert list(rep["parts"])[0] == "decode" and rep["loop"]["command"].startswith("python -m opdjax.cli train")
  assert "CPU backend" in rep["machine"], rep["machine"]  # the machine the parts ran on
  bf16, fp8 = d["lowered"]["bf16@64"]["floor_bytes"], d["lowered"]["fp8_kv_w8a16@64"]["floor_bytes"]
  assert 1.1e9 < bf16["weights"] < 1.3e9 and 1.8e9 < bf16["kv_mean_fill"] < 2.0e9  # the 1.19 + 1.88 GB
  assert fp8["kv_mean_fill"] < 0.6 * bf16["kv_mean_fill"] and fp8["weights"] < 0.7 * bf16["weights"]


def test_step_flops_survive_a_pjrt_c_api_backend(monkeypatch):
  """CUDA's backend is a PJRT C-API plugin, whose `Lowered.cost_analysis()` is None: the FLOP count
  (taken after the step was timed) must not fail there. Forced here for every backend; the count
  then comes from the compiled unrolled step and agrees with the pre-compile analysis."""
  from jax._src import xla_bridge

  sys.path.insert(0, os.path.join(ROOT, "bench"))
  import opd_step

  spec = {**opd_step.MODES["cpu"], "seq": 64, "prompt": 16, "vocab": 512}
  want = opd_step.step_flops(spec, "full")
  monkeypatch.setattr(xla_bridge, "using_pjrt_c_api", lambda backend=None: True)
  got = opd_step.step_flops(spec, "full")
  assert want > 1e6 and abs(got - want) <= 0.1 * want, (got, want)


def test_fp8_is_counted_in_the_compiled_program_not_by_any_cublas_call():
  """A compiled CUDA program whose only cuBLAS GEMM is the bf16 LM head has no FP8 GEMM (the old
  `"cublas" in hlo` said it had); cuBLASLt's f8 matmul calls are what count."""
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  import gpu_suite

  bf16 = ('%gemm = (bf16[8,151936]{1,0}, s8[0]{0}) custom-call(bf16[8,1024]{1,0} %x, bf16[1024,151936]{1,0} %w),'
          ' custom_call_target="__cublas$gemm"')
  f8 = ('%f8 = (bf16[8,3072]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[8,1024]{1,0} %a, f8e4m3fn[3072,1024]{1,0} %b,'
        ' f32[] %sa, f32[] %sb), custom_call_target="__cublas$lt$matmul$f8"')
  assert "cublas" in bf16 and gpu_suite.fp8_gemms(bf16) == 0
  assert gpu_suite.fp8_gemms("\n".join([bf16, f8, f8])) == 2
  rep = gpu_suite.empty_report(False, "full")
  assert rep["engine_decode"]["fp8_w8a8"]["fp8_gemms_compiled"] is None  # a field of the report, null until measured
  assert list(gpu_suite.PART_LIMITS_S) == list(gpu_suite.PARTS) and list(gpu_suite.PARTS)[0] == "decode"
  assert max(gpu_suite.PART_LIMITS_S.values()) <= gpu_suite.BUDGET_S


def test_gpu_suite_keeps_its_compilation_cache_outside_out_and_runs_python3(tmp_path):
  """Each part is a fresh process: without a persistent cache a rerun compiles everything cold again. The
  device tool empties $OUT before every call, so the cache lies in a git-ignored folder of the repo; the
  interpreter is `python3` unless PYTHON names one (the GPU image has no `python`)."""
  (tmp_path / "python3").write_text(
      '#!/bin/sh\necho "python3 cache=$JAX_COMPILATION_CACHE_DIR min=$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"\n')
  (tmp_path / "python3").chmod(0o755)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "PYTHON"}
  env.update(OUT=str(tmp_path / "out"), PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  proc = subprocess.run(["bash", "bench/gpu_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  cache = os.path.join(ROOT, "bench", ".jax-cache")
  assert proc.stdout.strip() == f"python3 cache={cache} min=0", proc.stdout + proc.stderr
  ignored = subprocess.run(["git", "check-ignore", "-q", cache + "/x"], cwd=ROOT)
  assert ignored.returncode == 0  # it never travels with the working tree, and stays on the machine


def test_a_part_cut_short_keeps_the_rows_it_printed(monkeypatch, capsys):
  """A child killed at its limit: the ROW / COMPILED lines it printed before are kept, in the report too."""
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  import _common
  import gpu_suite

  code = ("import json, time\n"
          "print('COMPILED ' + json.dumps({'variant': 'bf16', 'batch': 64, 'compile_s': 1.5}), flush=True)\n"
          "print('ROW ' + json.dumps({'variant': 'bf16', 'batch': 64, 'new_tokens_per_s': 40000, 'x_floor': 2.0}),"
          " flush=True)\n"
          "time.sleep(60)\n")
  got = _common.run_streaming([sys.executable, "-c", code], dict(os.environ), 4, "decode")
  assert got["returncode"] is None and got["result"] is None  # killed at the limit
  assert [r["batch"] for r in got["rows"]["ROW"]] == [64] and got["rows"]["COMPILED"][0]["compile_s"] == 1.5
  assert "[decode] ROW" in capsys.readouterr().out  # echoed as it came

  monkeypatch.setattr(gpu_suite._common, "run_streaming", lambda *a: got)
  opts = types.SimpleNamespace(remat="full", attention="auto", smoke=False)
  result, status = gpu_suite.run_part("decode", False, opts, 4)
  assert status["status"] == "timed out" and "kept the 1 rows" in status["error"]
  rep = gpu_suite.fill_report(gpu_suite.empty_report(False, "full"), {"decode": result})
  assert rep["decode_steps"]["rows"][0]["new_tokens_per_s"] == 40000
  assert rep["targets"]["decode_b64_tokens_per_s_ge_35000"] is True and rep["targets"]["decode_b64_x_floor_le_2.3"]


def test_decode_profile_sums_the_device_kernels_by_kind(tmp_path):
  """bench/decode_profile.py reads a jax.profiler perfetto trace: only the GPU's tracks count (the host's
  Python and runtime events are not device time), and each kernel is summed under its kind."""
  import gzip

  sys.path.insert(0, os.path.join(ROOT, "bench"))
  import decode_profile

  meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
          for p, n in ((1, "/device:GPU:0"), (2, "/host:CPU"))]
  kernels = [("memcpy128", 10), ("loop_dynamic_slice_fusion", 20), ("gemm_fusion_dot_24", 30),
             ("nvjet_sm90_tst_128x160", 5), ("cudnn_generated_fort_native_sdpa", 4), ("loop_add_fusion", 1)]
  events = meta + [{"ph": "X", "pid": 1, "tid": 1, "name": n, "ts": 0, "dur": us} for n, us in kernels]
  events += [{"ph": "X", "pid": 2, "tid": 1, "name": "ThunkExecutor::Execute", "ts": 0, "dur": 1000}]
  trace = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(trace, "wt") as f:
    json.dump({"traceEvents": events}, f)
  got = decode_profile.device_ops(str(tmp_path))  # a folder: the trace found under it
  assert got["tracks"] == ["/device:GPU:0"] and got["kernels"] == len(kernels)
  assert got["total_ms"] == 0.07 and got["ops"][0] == ["gemm_fusion_dot_24", 0.03, 1]
  assert got["groups_ms"] == {"matmuls": 0.035, "copies": 0.03, "attention": 0.004, "other": 0.001}
  assert decode_profile.device_ops(str(tmp_path / "nothing"))["error"].startswith("no perfetto_trace.json.gz")
