"""One prepared GPU run of the benchmarks the performance targets are tracked with (one H200, at
most 10 minutes cold), or with `--dry-run` a full-size trace of every part on any machine (< 3 minutes
on a CPU, nothing big allocated). Run it through `bench/gpu_suite.sh`.

    bash bench/gpu_suite.sh                 # the GPU machine: CUDA jax + CUDA torch (no vLLM needed)
    bash bench/gpu_suite.sh --dry-run       # anywhere: lowers every part at full size

Parts, each in its own subprocess (its own allocator: GPU memory is free again between parts) under
a time limit; a part that fails or runs out of time leaves its fields null and its error in `parts`:
- `opd_jax`: the opdjax OPD train step (bench/opd_step.py, gpu shapes: Qwen3-0.6B student with remat,
  Qwen3-1.7B teacher, 8 x 1024 tokens, full-vocab reverse KL, AdamW): tokens/s, device peak memory,
  compile seconds, FLOPs per step (XLA cost analysis) and MFU.
- `opd_torch`: the same step in PyTorch eager (HF Qwen3, SDPA, autocast bf16), same shapes.
- `engine`: JaxEngine rollouts (bench/rollout.py, gpu shapes: Qwen3-0.6B, batch 64, prompt 128, 256
  new tokens, temperature 1, no EOS) in bf16, with FP8 W8A8 matmuls (packed e4m3 per-channel weights,
  `fp8_matmul`) and with the FP8 weights dequantized in the loop; FP8 GEMMs counted in the compiled
  program (cuBLASLt's f8 matmul calls).
- `decode`: the engine's decode step against its memory floor (bench/decode_steps.py) at batch 16, 64 and
  256, bf16 / fp8 KV cache / fp8 KV cache + W8A16 weights (and fp8 KV + W8A8 at 256): step time, multiple
  of the floor, new tokens/s, kernels a step (profiler trace at batch 64), compile time.
- `decode_fill`: the bf16 decode step time at 10% and 90% fill of a 4096-slot cache (bench/decode_fill.py).
- `rollout_hf`: HF `generate`, the rollout shapes (one warm-up call of 8 tokens, one timed call).
- `loop`: the whole OPD loop, `opdjax train` end to end (configs/demo.py's addition task) on random HF
  folders of a Qwen3-0.6B-shaped student and a Qwen3-1.7B-shaped teacher, bf16, embedded engine, 30 steps
  of 64 rollouts x 128 new tokens, `train.timed` (the per-step split: sample, weight sync, train with the
  teacher's scoring inside the step). `opdjax train` reads ml_collections configs: where it is missing
  (the GPU image), gpu_suite.sh installs the wheels carried in bench/wheels/ (`bash bench/gpu_suite.sh
  --fetch-wheels` puts them there, on a machine with PyPI).
Weights are random, built on the device from the configs (nothing downloaded or written). Writes one
JSON (`$OUT/gpu_suite.json` when OUT is set, else bench/results/) and prints a markdown section for
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import types

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import _common  # noqa: E402
import decode_fill  # noqa: E402
import decode_steps  # noqa: E402
import opd_step  # noqa: E402
import rollout  # noqa: E402

# What the parts import (a test imports these with ml_collections blocked: the GPU image has none).
SUITE_MODULES = ("jax", "flax", "optax", "torch", "transformers", "opdjax.models", "opdjax.models.decoder",
                 "opdjax.models.quant", "opdjax.rollout", "opdjax.rollout.jax.engine", "opdjax.training.loss",
                 "opdjax.training.step", "opdjax.views.perturb")

MODE = "gpu"
OPD = opd_step.MODES["gpu"]
# HF generate runs ~1k tokens/s at these shapes: a short warm-up and one timed call keep it under 30 s.
ROLLOUT = {**rollout.MODES["gpu"], "repeats": 3, "hf_repeats": 1, "hf_warmup_new": 8}
FILL = decode_fill.MODES["gpu"]
DECODE = decode_steps.SPECS["gpu"]
DECODE_PLAN = decode_steps.TARGET_PLAN  # the target rows first (a part cut short keeps its rows)
LOOP = {"student": ROLLOUT["model"], "teacher": OPD["teacher"], "vocab": OPD["vocab"], "dtype": "bfloat16",
        "batch": 64, "new": 128, "steps": 30, "num_eval": 64}


def use_smoke_shapes() -> None:
  """`--smoke`: the measuring code paths (not the dry run's) on tiny CPU shapes, to check the
  suite itself before a GPU is spent on it."""
  global MODE, OPD, ROLLOUT, FILL, DECODE, DECODE_PLAN, LOOP
  MODE = "cpu"
  OPD = {**opd_step.MODES["cpu"], "seq": 128, "prompt": 32, "warmup": 1, "steps": 2}
  ROLLOUT = {**rollout.MODES["cpu"], "batch": 4, "prompt": 16, "new": 16, "repeats": 1, "hf_repeats": 1,
             "hf_warmup_new": 4}
  FILL = {**decode_fill.MODES["cpu"], "batch": 2, "max_len": 1024, "steps": 4, "repeats": 1}
  DECODE = decode_steps.SPECS["cpu"]
  DECODE_PLAN = decode_steps.plan((2, 4), w8a8_batches=(4,))
  LOOP = {"student": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=128),
          "teacher": dict(hidden=96, layers=2, heads=4, kv=2, head_dim=16, inter=192), "vocab": 512,
          "dtype": "float32", "batch": 8, "new": 8, "steps": 3, "num_eval": 16}
FP8_RECIPE = "fp8"  # views.perturb preset: every layer matrix fp8_e4m3 per channel, embeddings bf16

# The first run on a GPU node is cold (no compilation cache): each limit holds its part's compiles
# uncached (opd_jax: the train step and the unrolled FLOP-count program; engine: three generate
# programs; decode_fill: a 4-branch decode loop). gpu_suite.sh keeps a persistent compilation cache,
# so a rerun of a part (the device window leaves room for one) compiles nothing again.
# The suite's first run took 166 s cold with the scanned decoder (parts 22, 18, 85, 13 and 28 s); the
# engine's decode layers are straight-line code now, and compile longer.
BUDGET_S = 540  # the whole suite: 9 of the 15 minutes one H200 is lent for, a rerun's room left
DRY_BUDGET_S = 170  # the dry run, under 3 minutes
# In run order: decode first (its rows decide the open targets), each later part gets its limit or what is left
# of the budget, whichever is less.
PART_LIMITS_S = {"decode": 240, "engine": 100, "opd_jax": 80, "opd_torch": 40, "decode_fill": 30, "rollout_hf": 40,
                 "loop": 100}

TARGETS = {  # from the issue (one H200)
    "opd_speedup": 1.5, "opd_tokens_per_s": 42_700, "opd_peak_mem_ratio": 0.5, "opd_mfu": 0.40,
    "rollout_speedup": 20.0, "rollout_tokens_per_s": 19_500, "fp8_decode_speedup": 1.3,
    "decode_b64_tokens_per_s": 35_000, "decode_b64_x_floor": 2.3, "decode_b256_tokens_per_s": 65_000,
    "fp8_kv_w8a16_speedup_b64": 1.3,
}


# --- parts (children) ----------------------------------------------------------------------------

def _args(**kw) -> types.SimpleNamespace:
  return types.SimpleNamespace(mode=MODE, share_weights=False, weights_dir=None, **kw)


def _count(tree) -> int:
  import jax
  return sum(x.size for x in jax.tree.leaves(tree))


def _versions() -> dict:
  import jax
  return {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
          "machine": _common.machine()}


def part_opd_jax(dry: bool, opts) -> dict:
  if not dry:
    r = opd_step.jax_side(_args(remat=opts.remat, attention=opts.attention), OPD)
    return {**r, **_versions()}
  student, teacher, optimizer, step = opd_step.build_step(OPD, opts.remat, attention_impl=opts.attention)
  inputs = opd_step.abstract_inputs(student, teacher, optimizer, OPD)
  t0 = time.perf_counter()
  text = step.lower(*inputs).as_text()
  lower_s = time.perf_counter() - t0
  return {"lower_s": lower_s, "hlo_chars": len(text), "flops_per_step": opd_step.step_flops(OPD, opts.remat),
          "attention": opd_step.attention_used(OPD, opts.attention), "remat_policy": opts.remat,
          "student_params": _count(inputs[0].params), "teacher_params": _count(inputs[1]), **_versions()}


def _hf_param_counts(cfgs: dict) -> dict:
  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  with torch.device("meta"):
    return {w: sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Config.from_dict(c.to_hf_dict())).parameters())
            for w, c in cfgs.items()}


def _torch_versions() -> dict:
  import torch
  import transformers
  return {"torch": torch.__version__, "transformers": transformers.__version__}


def part_opd_torch(dry: bool, opts) -> dict:
  if not dry:
    return {**opd_step.torch_side(_args(), OPD), **_torch_versions()}
  counts = _hf_param_counts({w: opd_step.model_config(OPD[w], OPD) for w in ("student", "teacher")})
  return {"student_params": counts["student"], "teacher_params": counts["teacher"], **_torch_versions()}


def _fp8_count(text: str) -> int:
  """dot_generals of the lowered program whose two operands are both float8_e4m3: what was asked
  for (the same on every backend), not what runs."""
  return sum(1 for line in text.splitlines()
             if "dot_general" in line and line.count("xf8E4M3FN>") >= 2 and "f8E4M3FN>) ->" in line)


FP8_GEMM_CALL = "__cublas$lt$matmul$f8"


def fp8_gemms(compiled_text: str) -> int:
  """FP8 GEMMs of a compiled CUDA program: cuBLASLt's f8 custom call. Not `"cublas" in text` (the
  bf16 LM head is a cuBLAS GEMM too), nor f8 dots in the lowered program (XLA may upcast them)."""
  return compiled_text.count(f'custom_call_target="{FP8_GEMM_CALL}"')


def part_engine(dry: bool, opts) -> dict:
  """bf16, FP8 W8A8 and FP8-dequantized engines on the rollout shapes, then the decode-fill timing."""
  import jax
  import jax.numpy as jnp

  from opdjax.models import Model
  from opdjax.rollout import JaxEngine, SamplingParams
  from opdjax.rollout.jax.engine import install_params
  from opdjax.views import perturb

  spec = ROLLOUT
  cfg = rollout.model_config(spec).replace(attention_impl=opts.attention)
  b, p, n = spec["batch"], spec["prompt"], spec["new"]
  sampling = SamplingParams(max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=0)
  recipe = perturb.preset(FP8_RECIPE, cfg.num_layers, keep_edge_layers=0)
  models = {"bf16": Model(cfg), "fp8_w8a8": Model(cfg.replace(act_quant="fp8_e4m3", fp8_matmul=True)),
            "fp8_weight_only": Model(cfg)}
  init = models["bf16"].init
  pack = lambda params: perturb.apply_recipe(params, recipe, pack=True)
  out: dict = {"variants": {}, **_versions()}
  if dry:
    raw = jax.eval_shape(init, jax.random.key(0))
    packed = jax.eval_shape(lambda: pack(init(jax.random.key(0))))
  else:
    raw = jax.jit(init)(jax.random.key(0))
    packed = jax.jit(pack)(raw)
  for name, model in models.items():
    engine = JaxEngine(model, None, max_len=p + n, pad_id=0, eos_ids=())
    params = raw if name == "bf16" else packed
    fn = engine._fn(sampling)
    prepared = jax.eval_shape(lambda x, m=model: install_params(x, m), params)
    cache = jax.eval_shape(lambda m=model: m.init_cache(b, p + n))
    t0 = time.perf_counter()
    text = fn.lower(prepared, cache, jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b, p), bool),
                    jax.eval_shape(lambda: jax.random.key(0))).as_text()
    res = {"lower_s": time.perf_counter() - t0, "fp8_dots_in_program": _fp8_count(text)}
    if not dry:
      engine.sync(params, 0)
      # The compiled program the engine runs (its first call then loads it from the persistent cache).
      compiled = fn.lower(engine._params, cache, jax.ShapeDtypeStruct((b, p), jnp.int32),
                          jax.ShapeDtypeStruct((b, p), bool), jax.eval_shape(lambda: jax.random.key(0))).compile()
      res["fp8_gemms_compiled"] = fp8_gemms(compiled.as_text()) if jax.default_backend() == "gpu" else None
      res.update(rollout.time_generate(engine, rollout.make_prompts(spec), sampling, spec["repeats"]))
      assert res["generated"] == b * n, res["generated"]
      engine.close()
    del engine
    out["variants"][name] = res

  out["params"] = _count(jax.eval_shape(init, jax.random.key(0)))
  return out


def part_decode_fill(dry: bool, opts) -> dict:
  """The bf16 decode step at 10% and 90% fill of a 4096-slot cache: its own part (its 4-branch loop
  compiles cold in about as long as the engine's three programs together)."""
  import jax
  import jax.numpy as jnp

  from opdjax.models import Model
  from opdjax.rollout.jax.engine import install_params

  model = Model(rollout.model_config(ROLLOUT).replace(attention_impl=opts.attention))
  raw = jax.eval_shape(model.init, jax.random.key(0)) if dry else jax.jit(model.init)(jax.random.key(0))
  loop = decode_fill.decode_loop(model, FILL["steps"])
  bs, s = FILL["batch"], FILL["max_len"]
  i32 = jax.ShapeDtypeStruct((bs,), jnp.int32)
  t0 = time.perf_counter()
  loop.lower(jax.eval_shape(lambda x: install_params(x, model), raw), jax.eval_shape(lambda: model.init_cache(bs, s)),
             i32, i32, i32)
  out = {"lower_s": time.perf_counter() - t0, **_versions()}
  if not dry:
    params = jax.jit(lambda x: install_params(x, model))(raw)
    del raw
    out.update(decode_fill.measure(model, params, FILL))
  return out


def part_decode(dry: bool, opts) -> dict:
  """The decode step per variant and batch against its floor (bench/decode_steps.py)."""
  if dry:
    return {"lowered": decode_steps.lower_all(DECODE, DECODE_PLAN), **_versions()}
  rows = decode_steps.run_all(DECODE, DECODE_PLAN, trace_batch=64 if MODE == "gpu" else None)
  return {"rows": rows, "compiled": [{k: r[k] for k in ("variant", "batch", "compile_s")} for r in rows],
          **_versions()}


def part_rollout_hf(dry: bool, opts) -> dict:
  if not dry:
    return {**rollout.torch_side(_args(), ROLLOUT), **_torch_versions()}
  return {"params": _hf_param_counts({"model": rollout.model_config(ROLLOUT)})["model"], **_torch_versions()}


def loop_command(student: str, teacher: str, out: str) -> list[str]:
  # `python -m opdjax.cli`: the repo travels to the GPU uninstalled, without an `opdjax` executable.
  return [sys.executable, "-m", "opdjax.cli", "train", "--config", "configs/demo.py", "--out", out,
          f"--config.student.path={student}",
          f"--config.teacher.path={teacher}", f"--config.model.dtype={LOOP['dtype']}",
          "--config.model.remat_policy=full",
          f"--config.rollout.batch_size={LOOP['batch']}", f"--config.rollout.max_new_tokens={LOOP['new']}",
          f"--config.rollout.max_len={LOOP['new'] + 32}", f"--config.train.steps={LOOP['steps']}",
          "--config.train.timed=True", "--config.train.eval_every=100000", f"--config.task.num_eval={LOOP['num_eval']}",
          "--config.train.checkpoint_every=0"]


def _loop_model(shape: dict):
  from opdjax.models import ModelConfig
  from opdjax.tasks.addition import BOS, EOS, PAD

  return ModelConfig(model_type="qwen3", vocab_size=LOOP["vocab"], hidden_size=shape["hidden"],
                     intermediate_size=shape["inter"], num_layers=shape["layers"], num_heads=shape["heads"],
                     num_kv_heads=shape["kv"], head_dim=shape["head_dim"], rope_theta=1e6, tie_word_embeddings=True,
                     max_position_embeddings=40960, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def part_loop(dry: bool, opts) -> dict:
  """`opdjax train` end to end on random Qwen3-shaped HF folders (the addition task's tokens are ids
  below its small vocabulary; the models' 152k-way softmax samples everything else too)."""
  import statistics
  import tempfile

  import jax

  from opdjax.models import Model, save_hf_params

  tmp = tempfile.mkdtemp(prefix="gpu-suite-loop-")
  paths = {role: os.path.join(tmp, role) for role in ("student", "teacher")}
  cmd = loop_command(paths["student"], paths["teacher"], os.path.join(tmp, "run"))
  out = {"command": " ".join(["python"] + cmd[1:6] + ["--out DIR", "--config.student.path=S", "--config.teacher.path=T"]
                             + cmd[10:]),
         **_versions()}
  if dry:
    return out
  import glob
  import importlib.util
  wheels = sorted(glob.glob(os.path.join(BENCH, "wheels", "*.whl")))
  if importlib.util.find_spec("ml_collections") is None and wheels:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", *wheels], check=True)
  if importlib.util.find_spec("ml_collections") is None:
    raise RuntimeError("`opdjax train` needs ml_collections: run `bash bench/gpu_suite.sh --fetch-wheels` where PyPI"
                       " is reachable and carry bench/wheels/ to this machine (this part installs them).")
  t0 = time.perf_counter()
  for role, shape in (("student", LOOP["student"]), ("teacher", LOOP["teacher"])):
    cfg = _loop_model(shape)
    params = jax.jit(Model(cfg).init)(jax.random.key(0 if role == "student" else 1))
    save_hf_params(jax.device_get(params), cfg, paths[role])  # fp32 files; the run computes in LOOP's dtype
    del params
  out["write_models_s"] = round(time.perf_counter() - t0, 1)
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=os.path.dirname(BENCH), capture_output=True, text=True)
  out["train_wall_s"] = round(time.perf_counter() - t0, 1)
  if proc.returncode:
    raise RuntimeError(f"opdjax train exited {proc.returncode}: {proc.stderr[-2000:]}")
  with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  steps = [r for r in recs if "time_train_s" in r]
  later = steps[1:] or steps  # step 1 compiles
  keys = sorted({k for r in later for k in r if k.startswith("time_") and k.endswith("_s")})
  out["first_step_s"] = round(steps[0]["elapsed_s"], 2) if steps and "elapsed_s" in steps[0] else None
  out["split_median_s"] = {k: round(statistics.median(r[k] for r in later if k in r), 4) for k in keys}
  # elapsed_s is stamped when a record is written (after the next step is dispatched): over 29 steps its
  # differences are the loop's pace; the split's stages are timed one by one (train.timed waits for each).
  walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(later, later[1:]) if "elapsed_s" in a and "elapsed_s" in b]
  out["step_s"] = round(statistics.median(walls), 4) if walls else None
  out["split_sum_s"] = round(sum(out["split_median_s"].values()), 4)
  out["new_tokens_per_step"] = statistics.median(r["num_tokens"] for r in later) if later else None
  out["tokens_per_s"] = round(out["new_tokens_per_step"] / out["step_s"]) if out["step_s"] else None
  out["steps"] = len(steps)
  out["reverse_kl"] = [recs[0].get("reverse_kl"), steps[-1].get("train_reverse_kl") if steps else None]
  return out


PARTS = {"decode": part_decode, "engine": part_engine, "opd_jax": part_opd_jax, "opd_torch": part_opd_torch,
         "decode_fill": part_decode_fill, "rollout_hf": part_rollout_hf, "loop": part_loop}


# --- the report ----------------------------------------------------------------------------------

def empty_report(dry: bool, remat: str, smoke: bool = False, budget: float | None = None) -> dict:
  """Every field the suite reports; measurements stay None until a part fills them (always in a dry run)."""
  gen = lambda: {"new_tokens_per_s": None, "call_s": None, "first_call_s": None}
  return {
      "suite": "opdjax bench/gpu_suite.py", "dry_run": dry, "smoke": smoke, "date": None, "machine": None,
      "command": None,
      "versions": {"jax": None, "torch": None, "transformers": None}, "device": None, "backend": None,
      "wall_s": None, "budget_s": budget or (DRY_BUDGET_S if dry else BUDGET_S),
      "opd_step": {
          "shapes": opd_step.shapes_line(OPD),
          "opdjax": {"tokens_per_s": None, "step_ms": None, "peak_gib": None, "compile_s": None,
                     "flops_per_step": None, "tflops_per_s": None, "mfu": None, "attention": None,
                     "remat_policy": remat, "first_loss": None, "params": None},
          "pytorch": {"tokens_per_s": None, "step_ms": None, "peak_gib": None, "warmup_s": None, "first_loss": None,
                      "attention": None, "params": None},
          "speedup": None, "peak_mem_ratio": None,
      },
      "rollout": {"shapes": rollout.shapes_line(ROLLOUT), "opdjax": gen(),
                  "hf_generate": {"new_tokens_per_s": None, "call_s": None, "warmup_s": None, "params": None},
                  "speedup": None},
      "engine_decode": {"recipe": f"views preset {FP8_RECIPE!r}, keep_edge_layers=0 (layer matrices fp8_e4m3 per"
                                  " channel, embeddings bf16)",
                        "bf16": gen(), "fp8_w8a8": {**gen(), "fp8_dots_in_program": None, "fp8_gemms_compiled": None},
                        "fp8_weight_only": {**gen(), "fp8_dots_in_program": None, "fp8_gemms_compiled": None},
                        "fp8_w8a8_speedup": None, "fp8_weight_only_speedup": None},
      "decode_fill": {"shapes": decode_fill.shapes_line(FILL), "step_ms_10pct": None, "step_ms_90pct": None,
                      "ratio": None},
      "decode_steps": {"shapes": decode_steps.shapes_line(DECODE), "steps_per_call": DECODE["steps"],
                       "fill": "prompt + new / 2 of prompt + new slots",
                       "copy_tb_s": decode_steps.decode_profile.HBM_COPY_TB_S,
                       "plan": [f"{v}@{b}" for v, b in DECODE_PLAN], "rows": [], "compiled": [], "lowered": None,
                       "fp8_kv_speedup_b64": None, "fp8_kv_w8a16_speedup_b64": None},
      "loop": {"shapes": (f"student {LOOP['student']}, teacher {LOOP['teacher']}, vocab {LOOP['vocab']},"
                          f" {LOOP['dtype']}; {LOOP['batch']} rollouts x {LOOP['new']} new tokens a step,"
                          f" {LOOP['steps']} steps, embedded JAX engine, configs/demo.py's task"),
               "command": None, "steps": None, "step_s": None, "first_step_s": None, "tokens_per_s": None,
               "new_tokens_per_step": None, "split_median_s": None, "split_sum_s": None, "write_models_s": None,
               "train_wall_s": None,
               "reverse_kl": None},
      "compile_s": {"train_step": None, "generate_bf16": None, "generate_fp8_w8a8": None,
                    "generate_fp8_weight_only": None, "decode_fill_loop": None},
      "trace_s": {"train_step": None, "generate_bf16": None, "generate_fp8_w8a8": None,
                  "generate_fp8_weight_only": None, "decode_fill_loop": None},
      "targets": {"opd_speedup_ge_1.5": None, "opd_tokens_per_s_ge_42700": None, "opd_peak_mem_ratio_le_0.5": None,
                  "opd_mfu_ge_0.4": None, "rollout_speedup_ge_20": None, "rollout_tokens_per_s_ge_19500": None,
                  "fp8_decode_speedup_ge_1.3": None, "decode_b64_tokens_per_s_ge_35000": None,
                  "decode_b64_x_floor_le_2.3": None, "decode_b256_tokens_per_s_ge_65000": None,
                  "fp8_kv_w8a16_speedup_b64_ge_1.3": None},
      "parts": {name: {"status": "not run", "seconds": None, "error": None} for name in PARTS},
  }


def _ge(x, bound):
  return None if x is None else bool(x >= bound)


def fill_report(rep: dict, results: dict) -> dict:
  """Puts the parts' results into the report's fields and derives the ratios and target checks."""
  gib = lambda b: None if b is None else round(b / 2**30, 3)
  tokens = OPD["batch"] * OPD["seq"]
  new_tokens = ROLLOUT["batch"] * ROLLOUT["new"]
  for r in results.values():
    for k in ("jax", "torch", "transformers"):
      rep["versions"][k] = r.get(k, rep["versions"][k])
    if r.get("device") and r.get("backend"):
      rep["device"], rep["backend"] = r["device"], r["backend"]
    rep["machine"] = r.get("machine", rep["machine"])

  if "opd_jax" in results:
    r, o = results["opd_jax"], rep["opd_step"]["opdjax"]
    o.update(flops_per_step=r.get("flops_per_step"), attention=r.get("attention"),
             params=r.get("student_params"), remat_policy=r.get("remat_policy", o["remat_policy"]))
    rep["trace_s"]["train_step"] = round(r["lower_s"], 2) if "lower_s" in r else None
    if "step_s" in r:
      o.update(tokens_per_s=round(tokens / r["step_s"], 1), step_ms=round(r["step_s"] * 1e3, 2),
               peak_gib=gib(r["peak_bytes"]), compile_s=round(r["compile_s"], 2), first_loss=r["first_loss"])
      o["tflops_per_s"] = round(r["flops_per_step"] / r["step_s"] / 1e12, 2)
      peak = _common.peak_flops(r["device"], OPD["dtype"])
      o["mfu"] = round(r["flops_per_step"] / r["step_s"] / peak, 4) if peak else None
      rep["compile_s"]["train_step"] = o["compile_s"]
  if "opd_torch" in results:
    r, t = results["opd_torch"], rep["opd_step"]["pytorch"]
    t["params"] = r.get("student_params")
    if "step_s" in r:
      t.update(tokens_per_s=round(tokens / r["step_s"], 1), step_ms=round(r["step_s"] * 1e3, 2),
               peak_gib=gib(r["peak_bytes"]), warmup_s=round(r["compile_s"], 2), first_loss=r["first_loss"],
               attention=r["framework"].split("attn ")[-1])
  o, t = rep["opd_step"]["opdjax"], rep["opd_step"]["pytorch"]
  if o["tokens_per_s"] and t["tokens_per_s"]:
    rep["opd_step"]["speedup"] = round(o["tokens_per_s"] / t["tokens_per_s"], 3)
    rep["opd_step"]["peak_mem_ratio"] = round(o["peak_gib"] / t["peak_gib"], 3)

  if "engine" in results:
    r = results["engine"]
    for name, v in r.get("variants", {}).items():
      e = rep["engine_decode"][name]
      rep["trace_s"][f"generate_{name}"] = round(v["lower_s"], 2)
      for k in ("fp8_dots_in_program", "fp8_gemms_compiled"):
        if k in e and k in v:
          e[k] = v[k]
      if "call_s" in v:
        e.update(new_tokens_per_s=round(new_tokens / v["call_s"], 1), call_s=round(v["call_s"], 4),
                 first_call_s=round(v["first_call_s"], 2))
        rep["compile_s"][f"generate_{name}"] = round(v["first_call_s"] - v["call_s"], 2)
    rep["rollout"]["opdjax"] = dict(rep["engine_decode"]["bf16"])
    bf16 = rep["engine_decode"]["bf16"]["new_tokens_per_s"]
    for name in ("fp8_w8a8", "fp8_weight_only"):
      fp8 = rep["engine_decode"][name]["new_tokens_per_s"]
      rep["engine_decode"][f"{name}_speedup"] = round(fp8 / bf16, 3) if fp8 and bf16 else None
  if "decode_fill" in results:
    fill = results["decode_fill"]
    rep["trace_s"]["decode_fill_loop"] = round(fill["lower_s"], 2) if "lower_s" in fill else None
    if "ratio" in fill:
      rep["decode_fill"].update(step_ms_10pct=round(fill["step_ms_10pct"], 3),
                                step_ms_90pct=round(fill["step_ms_90pct"], 3), ratio=round(fill["ratio"], 3))
      rep["compile_s"]["decode_fill_loop"] = round(fill["compile_s"], 2)
  if "decode" in results:
    d, r = rep["decode_steps"], results["decode"]
    d["lowered"], d["rows"], d["compiled"] = r.get("lowered"), r.get("rows", []), r.get("compiled", [])
    at = {(x["variant"], x["batch"]): x for x in d["rows"]}
    speed = lambda v: (at[(v, 64)]["new_tokens_per_s"] / at[("bf16", 64)]["new_tokens_per_s"]
                       if (v, 64) in at and ("bf16", 64) in at else None)
    for v in ("fp8_kv", "fp8_kv_w8a16"):
      d[f"{v}_speedup_b64"] = None if speed(v) is None else round(speed(v), 3)
    get = lambda v, b, k: at[(v, b)][k] if (v, b) in at else None
    rep["targets"].update({
        "decode_b64_tokens_per_s_ge_35000": _ge(get("bf16", 64, "new_tokens_per_s"),
                                                TARGETS["decode_b64_tokens_per_s"]),
        "decode_b64_x_floor_le_2.3": (None if get("bf16", 64, "x_floor") is None
                                      else get("bf16", 64, "x_floor") <= TARGETS["decode_b64_x_floor"]),
        "decode_b256_tokens_per_s_ge_65000": _ge(get("bf16", 256, "new_tokens_per_s"),
                                                 TARGETS["decode_b256_tokens_per_s"]),
        "fp8_kv_w8a16_speedup_b64_ge_1.3": _ge(d["fp8_kv_w8a16_speedup_b64"], TARGETS["fp8_kv_w8a16_speedup_b64"]),
    })
  if "loop" in results:
    rep["loop"].update({k: v for k, v in results["loop"].items() if k in rep["loop"]})
  if "rollout_hf" in results:
    r, h = results["rollout_hf"], rep["rollout"]["hf_generate"]
    h["params"] = r.get("params")
    if "call_s" in r:
      h.update(new_tokens_per_s=round(new_tokens / r["call_s"], 1), call_s=round(r["call_s"], 3),
               warmup_s=round(r["first_call_s"], 2))
  ro, hf = rep["rollout"]["opdjax"]["new_tokens_per_s"], rep["rollout"]["hf_generate"]["new_tokens_per_s"]
  rep["rollout"]["speedup"] = round(ro / hf, 3) if ro and hf else None

  fp8 = [x for x in (rep["engine_decode"]["fp8_w8a8_speedup"], rep["engine_decode"]["fp8_weight_only_speedup"])
         if x is not None]
  rep["targets"].update({  # (the decode targets were set above, with the decode part's rows)
      "opd_speedup_ge_1.5": _ge(rep["opd_step"]["speedup"], TARGETS["opd_speedup"]),
      "opd_tokens_per_s_ge_42700": _ge(o["tokens_per_s"], TARGETS["opd_tokens_per_s"]),
      "opd_peak_mem_ratio_le_0.5": (None if rep["opd_step"]["peak_mem_ratio"] is None
                                    else rep["opd_step"]["peak_mem_ratio"] <= TARGETS["opd_peak_mem_ratio"]),
      "opd_mfu_ge_0.4": _ge(o["mfu"], TARGETS["opd_mfu"]),
      "rollout_speedup_ge_20": _ge(rep["rollout"]["speedup"], TARGETS["rollout_speedup"]),
      "rollout_tokens_per_s_ge_19500": _ge(ro, TARGETS["rollout_tokens_per_s"]),
      "fp8_decode_speedup_ge_1.3": _ge(max(fp8) if fp8 else None, TARGETS["fp8_decode_speedup"]),
  })
  return rep


def markdown(rep: dict, title: bool = True) -> str:
  """The section for BENCHMARKS.md (scripts/docs.py renders a recorded run's with `title=False`)."""
  def f(x, fmt="{:,.0f}"):
    return "n/a" if x is None else fmt.format(x)

  def met(x):
    return {None: "n/a", True: "yes", False: "no"}[x]

  o, t, tg = rep["opd_step"]["opdjax"], rep["opd_step"]["pytorch"], rep["targets"]
  e, ro = rep["engine_decode"], rep["rollout"]
  rows = [
      ["OPD step tokens/s", f(o["tokens_per_s"]), f"{f(t['tokens_per_s'])} (PyTorch eager)",
       f(rep["opd_step"]["speedup"], "{:.2f}x"), ">= 1.5x and >= 42,700",
       f"{met(tg['opd_speedup_ge_1.5'])} / {met(tg['opd_tokens_per_s_ge_42700'])}"],
      ["OPD step peak memory (GiB)", f(o["peak_gib"], "{:.1f}"), f(t["peak_gib"], "{:.1f}"),
       f(rep["opd_step"]["peak_mem_ratio"], "{:.2f}x"), "<= 0.5x", met(tg["opd_peak_mem_ratio_le_0.5"])],
      ["OPD step MFU (XLA FLOPs)", f(o["mfu"], "{:.1%}"), "", f(o["tflops_per_s"], "{:.0f} TFLOP/s"), ">= 40%",
       met(tg["opd_mfu_ge_0.4"])],
      ["rollout new tokens/s", f(ro["opdjax"]["new_tokens_per_s"]), f"{f(ro['hf_generate']['new_tokens_per_s'])}"
       " (HF generate)", f(ro["speedup"], "{:.1f}x"), ">= 20x and >= 19,500 (aim 50k)",
       f"{met(tg['rollout_speedup_ge_20'])} / {met(tg['rollout_tokens_per_s_ge_19500'])}"],
      ["engine decode new tokens/s, FP8 W8A8 (cuBLASLt f8 GEMMs compiled:"
       f" {f(e['fp8_w8a8']['fp8_gemms_compiled'])})", f(e["fp8_w8a8"]["new_tokens_per_s"]),
       f"{f(e['bf16']['new_tokens_per_s'])} (bf16)", f(e["fp8_w8a8_speedup"], "{:.2f}x"), ">= 1.3x",
       met(tg["fp8_decode_speedup_ge_1.3"])],
      ["engine decode new tokens/s, FP8 weights " + ("W8A16 (fp8 upcast in the dot)" if rep.get("decode_steps")
                                                   else "dequantized"), f(e["fp8_weight_only"]["new_tokens_per_s"]),
       f"{f(e['bf16']['new_tokens_per_s'])} (bf16)", f(e["fp8_weight_only_speedup"], "{:.2f}x"), ">= 1.3x", ""],
      [f"decode step, 10% / 90% of {FILL['max_len']} slots (ms)",
       f"{f(rep['decode_fill']['step_ms_10pct'], '{:.2f}')} / {f(rep['decode_fill']['step_ms_90pct'], '{:.2f}')}",
       "", f(rep["decode_fill"]["ratio"], "{:.2f}"), "< 1 (cost grows with fill)", ""],
  ]
  comp = ", ".join(f"{k} {f(v, '{:.1f}')} s" for k, v in rep["compile_s"].items())
  trace = ", ".join(f"{k} {f(v, '{:.1f}')} s" for k, v in rep["trace_s"].items())
  failed = [f"{k}: {v['status']}" + (f" ({v['error']})" if v["error"] else "") for k, v in rep["parts"].items()
            if v["status"] != "ok"]
  heading = ("GPU suite (dry run: traces only)" if rep["dry_run"] else
           "GPU suite (smoke run: tiny CPU shapes)" if rep["smoke"] else f"GPU suite ({rep['device']})")
  lines = ([f"## {heading}", ""] if title else []) + [f"- Date: {rep['date']}", f"- Machine: {rep['machine']}",
           f"- Command: `{rep['command']}`",
           f"- Versions: jax {rep['versions']['jax']}, torch {rep['versions']['torch']}, transformers"
           f" {rep['versions']['transformers']}; backend {rep['backend']};"
           f" suite wall time {f(rep['wall_s'], '{:.0f}')} s",
           f"- OPD step: {rep['opd_step']['shapes']}; opdjax attention {o['attention']}, student remat"
           f" {o['remat_policy']}, {f(o['flops_per_step'], '{:.3e}')} FLOPs per step (XLA HLO cost analysis of the"
           " step lowered without loops)",
           f"- Rollout / engine: {ro['shapes']}; FP8 recipe: {e['recipe']}",
           f"- Decode fill: {rep['decode_fill']['shapes']}",
           f"- Compile (first call minus a timed call for the engine): {comp}",
           f"- Lowering: {trace}"]
  lines += [f"- Parts not ok: {'; '.join(failed)}"] if failed else []
  lines += ["", _common.markdown_table(["what", "opdjax", "baseline", "ratio", "target", "met"], rows), ""]
  if rep.get("decode_steps"):  # runs before the per-layer engine have no decode or loop part
    lines += decode_markdown(rep, f, met)
    lp = rep["loop"]
    split = ", ".join(f"{k[5:-2]} {v * 1e3:.0f} ms" for k, v in (lp["split_median_s"] or {}).items())
    lines += [f"The whole OPD loop (`{lp['command']}`; {lp['shapes']}): {f(lp['step_s'], '{:.2f}')} s a step"
              f" (median after the first, which took {f(lp['first_step_s'], '{:.0f}')} s), {f(lp['tokens_per_s'])}"
              f" tokens/s; split (medians, each stage waited for): {split or 'n/a'}, together"
              f" {f(lp['split_sum_s'], '{:.2f}')} s.", ""]
  return "\n".join(lines)


def decode_markdown(rep: dict, f, met) -> list[str]:
  d, tg = rep["decode_steps"], rep["targets"]
  rows = [[r["variant"], str(r["batch"]), f(r["step_ms"], "{:.3f}"), f(r["x_floor"], "{:.2f}x"),
           f(r["x_floor_whole_cache"], "{:.2f}x"), f(r["new_tokens_per_s"]), f(r["kernels_per_step"], "{:.0f}"),
           f(r["compile_s"], "{:.1f}")] for r in d["rows"]]
  head = ["variant", "batch", "step (ms)", "x floor (mean fill)", "x floor (whole cache)", "new tokens/s",
          "kernels a step", "compile (s)"]
  return [f"Decode step against its memory floor ({d['shapes']}; {d['steps_per_call']} steps a call from a cache"
          f" at {d['fill']}; floor: weights as stored + KV bytes at {d['copy_tb_s']} TB/s):", "",
          _common.markdown_table(head, rows) if rows else f"(not measured; planned: {', '.join(d['plan'])})", "",
          f"- batch 64 >= 35,000 new tokens/s: {met(tg['decode_b64_tokens_per_s_ge_35000'])}; <= 2.3x the floor:"
          f" {met(tg['decode_b64_x_floor_le_2.3'])}; batch 256 >= 65,000:"
          f" {met(tg['decode_b256_tokens_per_s_ge_65000'])}",
          "- compiled first, in parallel (s): " + (", ".join(f"{c['variant']}@{c['batch']} {c['compile_s']:.1f}"
                                                          for c in d.get("compiled") or []) or "n/a"),
          f"- fp8 KV cache at batch 64: {f(d['fp8_kv_speedup_b64'], '{:.2f}x')} bf16; fp8 KV + W8A16:"
          f" {f(d['fp8_kv_w8a16_speedup_b64'], '{:.2f}x')} (target >= 1.3x:"
          f" {met(tg['fp8_kv_w8a16_speedup_b64_ge_1.3'])})", ""]


# --- parent --------------------------------------------------------------------------------------

def run_part(name: str, dry: bool, opts, limit: float) -> tuple[dict | None, dict]:
  """One part in its own process under `limit` seconds. Rows it printed (`ROW` / `COMPILED` lines: the
  decode part's measured rows and compile seconds) are kept when it runs out of time or fails."""
  cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--remat", opts.remat, "--attention",
         opts.attention]
  cmd += (["--dry-run"] if dry else []) + (["--smoke"] if opts.smoke else [])
  env = dict(os.environ)
  if dry or opts.smoke:
    env.setdefault("JAX_PLATFORMS", "cpu")
  t0 = time.perf_counter()
  got = _common.run_streaming(cmd, env, limit, name)
  status = {"status": "ok", "seconds": round(time.perf_counter() - t0, 1), "error": None}
  result = got["result"]
  if got["returncode"] is None:
    status.update(status="timed out", error=f"killed after {limit:.0f} s")
  elif got["returncode"] or result is None:
    status.update(status="failed", error=f"exit code {got['returncode']}; see its stderr above")
  if result is None and (got["rows"]["ROW"] or got["rows"]["COMPILED"]):
    result = {"rows": got["rows"]["ROW"], "compiled": got["rows"]["COMPILED"], "partial": True}
    status["error"] += f"; kept the {len(got['rows']['ROW'])} rows it printed"
  return result, status


def child(name: str, dry: bool, opts) -> None:
  _common.emit(PARTS[name](dry, opts))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dry-run", action="store_true", help="lower every part at full size; no measurements")
  ap.add_argument("--remat", choices=("nothing", "dots", "full"), default="full",
                  help="the OPD student's remat policy (model.remat_policy)")
  ap.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                  help="attention implementation for training and prefill (ModelConfig.attention_impl)")
  ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
  ap.add_argument("--machine", help="machine description for the report (default: device and CPU)")
  ap.add_argument("--smoke", action="store_true", help="measure tiny CPU shapes: a check of the suite itself")
  ap.add_argument("--budget", type=float, metavar="S",
                  help=f"the whole suite's time limit in seconds (default {BUDGET_S}; dry run {DRY_BUDGET_S}): "
                       "leave the device call's own limit some seconds to write the report")
  ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
  opts = ap.parse_args()
  if opts.smoke:
    use_smoke_shapes()
  if opts.part:
    child(opts.part, opts.dry_run, opts)
    return 0

  dry = opts.dry_run
  start = time.perf_counter()
  budget = opts.budget or (DRY_BUDGET_S if dry else BUDGET_S)
  rep = empty_report(dry, opts.remat, opts.smoke, budget)
  rep["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  rep["command"] = "bash bench/gpu_suite.sh " + " ".join(sys.argv[1:])
  results = {}
  selected = [p for p in opts.parts.split(",") if p]
  for name in selected:
    if name not in PARTS:
      raise SystemExit(f"unknown part {name!r}; parts: {', '.join(PARTS)}")
    left = budget - (time.perf_counter() - start)
    limit = min(PART_LIMITS_S[name], left)
    print(f"== {name} ({'dry run, ' if dry else ''}limit {limit:.0f} s)", flush=True)
    if limit < 10:
      rep["parts"][name].update(status="skipped", error="suite time budget spent")
      continue
    result, rep["parts"][name] = run_part(name, dry, opts, limit)
    if result is not None:
      results[name] = result
  fill_report(rep, results)
  rep["wall_s"] = round(time.perf_counter() - start, 1)
  # What the parts' own processes ran on (their accelerator, jax and host), else this host.
  rep["machine"] = opts.machine or rep["machine"] or f"no part reported; host {_common.cpu_description()}"

  out_dir = os.environ.get("OUT") or os.path.join(BENCH, "results")
  os.makedirs(out_dir, exist_ok=True)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  if dry or opts.smoke:
    name = f"gpu_suite_{'dry_run' if dry else 'smoke'}.json"
  else:
    name = "gpu_suite.json" if os.environ.get("OUT") else f"gpu_suite-{stamp}.json"
  path = os.path.join(out_dir, name)
  with open(path, "w") as fh:
    json.dump(rep, fh, indent=1)
  print("\n" + markdown(rep))
  print(json.dumps(rep, indent=1))
  print(f"\nwrote {path}")
  return 0 if all(rep["parts"][n]["status"] == "ok" for n in selected) else 1


if __name__ == "__main__":
  sys.exit(main())
