"""Rollout throughput: opdjax `JaxEngine` vs Hugging Face `generate`, in one run.

Both sides sample (temperature 1, no top-k / top-p) from the same weights: opdjax
initialises a random Qwen3-shaped model, exports it with `save_hf_params`, and
transformers loads that folder. No EOS on either side (`eos_ids=()`;
`min_new_tokens = max_new_tokens`), so every row generates exactly `new` tokens
and tokens/s = batch x new / median wall time of one `generate` call (prefill
included). Each side runs in its own subprocess (see `_common.py`).

    PYTHONPATH=. python bench/rollout.py --mode cpu --threads 1
    PYTHONPATH=. python bench/rollout.py --mode gpu --out runs/rollout.md  # notes; not BENCHMARKS.md
    PYTHONPATH=. python bench/rollout.py --mode gpu --dry-run   # shapes only, any machine
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import _common

MODES = {
    "cpu": {
        "model": dict(hidden=256, layers=4, heads=4, kv=2, head_dim=64, inter=768), "vocab": 8192,
        "batch": 16, "prompt": 64, "new": 64, "dtype": "float32", "repeats": 3,
    },
    "gpu": {  # Qwen3-0.6B shape
        "model": dict(hidden=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072), "vocab": 151936,
        "batch": 64, "prompt": 128, "new": 256, "dtype": "bfloat16", "repeats": 3,
    },
}


def model_config(spec: dict):
  from opdjax.models import ModelConfig
  m = spec["model"]
  return ModelConfig(
      model_type="qwen3", vocab_size=spec["vocab"], hidden_size=m["hidden"], intermediate_size=m["inter"],
      num_layers=m["layers"], num_heads=m["heads"], num_kv_heads=m["kv"], head_dim=m["head_dim"],
      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
      max_position_embeddings=40960, dtype=spec["dtype"])


def shapes_line(spec: dict) -> str:
  m = spec["model"]
  return (f"hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv']} kv heads,"
          f" head_dim {m['head_dim']}, intermediate {m['inter']}, tied embeddings, vocab {spec['vocab']};"
          f" batch {spec['batch']}, prompt {spec['prompt']}, {spec['new']} new tokens; {spec['dtype']}"
          f" weights and compute; 1 warm-up + {spec['repeats']} timed calls")


def make_prompts(spec: dict) -> list[list[int]]:
  import numpy as np
  rng = np.random.default_rng(0)
  return rng.integers(0, spec["vocab"], size=(spec["batch"], spec["prompt"])).tolist()


def time_generate(engine, prompts, sampling, repeats: int) -> dict:
  """Wall and CPU seconds of `engine.generate`: a first call (compile + run), then `repeats` timed."""
  import jax

  def call(seed):
    r = engine.generate(prompts, sampling, seed=seed)
    jax.block_until_ready(r.completion_tokens)
    return r

  first_s, _, _ = _common.timed(lambda: call(0))
  walls, cpus = [], []
  for i in range(repeats):
    wall, cpu, r = _common.timed(functools.partial(call, i + 1))
    walls.append(wall)
    cpus.append(cpu)
  return {"call_s": statistics.median(walls), "times": walls, "cpu_call_s": statistics.median(cpus),
          "first_call_s": first_s, "generated": int(r.completion_mask.sum())}


def jax_side(args, spec) -> dict:
  import jax
  import jax.numpy as jnp

  from opdjax.models import Model, save_hf_params
  from opdjax.rollout import JaxEngine, SamplingParams

  if args.mode == "gpu" and jax.default_backend() != "gpu":
    raise SystemExit(f"--mode gpu needs a CUDA jax; jax.default_backend() is {jax.default_backend()!r}.")
  cfg = model_config(spec)
  model = Model(cfg)
  params = jax.jit(model.init)(jax.random.key(0))
  if args.share_weights:
    save_hf_params(params, cfg, args.weights_dir)
  params = jax.tree.map(lambda x: x.astype(jnp.dtype(spec["dtype"])), params)
  engine = JaxEngine(model, params, max_len=spec["prompt"] + spec["new"], pad_id=0, eos_ids=())
  sampling = SamplingParams(max_new_tokens=spec["new"], temperature=1.0, top_p=1.0, top_k=0)
  res = time_generate(engine, make_prompts(spec), sampling, spec["repeats"])
  assert res["generated"] == spec["batch"] * spec["new"], res["generated"]
  return {"side": "opdjax JaxEngine", **res, "device": jax.devices()[0].device_kind,
          "framework": f"jax {jax.__version__}"}


def torch_side(args, spec) -> dict:
  import torch
  import transformers
  from transformers import Qwen3Config, Qwen3ForCausalLM

  gpu = args.mode == "gpu"
  device = _common.torch_device(args.mode)
  dtype = getattr(torch, spec["dtype"])
  if args.share_weights:
    model = Qwen3ForCausalLM.from_pretrained(args.weights_dir, dtype=dtype).to(device)
  else:  # random weights built on the device: nothing written or read
    torch.manual_seed(0)
    with device:
      model = Qwen3ForCausalLM._from_config(Qwen3Config.from_dict(model_config(spec).to_hf_dict()), dtype=dtype)
  model = model.eval()
  input_ids = torch.tensor(make_prompts(spec), device=device)
  gen = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)

  def call(seed, new):
    torch.manual_seed(seed)
    with torch.inference_mode():
      out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new,
                           min_new_tokens=new, **gen)
    if gpu:
      torch.cuda.synchronize()
    return out

  # HF generate has nothing to compile: a short warm-up call initialises the kernels.
  first_s, _, _ = _common.timed(lambda: call(0, spec.get("hf_warmup_new", spec["new"])))
  walls, cpus = [], []
  for i in range(spec.get("hf_repeats", spec["repeats"])):
    wall, cpu, out = _common.timed(functools.partial(call, i + 1, spec["new"]))
    walls.append(wall)
    cpus.append(cpu)
  assert out.shape == (spec["batch"], spec["prompt"] + spec["new"]), out.shape
  return {"side": "HF generate", "call_s": statistics.median(walls), "times": walls,
          "cpu_call_s": statistics.median(cpus), "first_call_s": first_s,
          "generated": spec["batch"] * spec["new"],
          "device": torch.cuda.get_device_name() if gpu else "cpu",
          "framework": f"torch {torch.__version__}, transformers {transformers.__version__},"
                       f" attn {model.config._attn_implementation}, default (dynamic) KV cache"}


def dry_run(args, spec) -> None:
  """Param count and a trace of the whole prefill + decode loop at full size, nothing allocated."""
  import jax
  import jax.numpy as jnp

  from opdjax.models import Model
  from opdjax.rollout import JaxEngine, SamplingParams

  cfg = model_config(spec)
  model = Model(cfg)
  dt = jnp.dtype(spec["dtype"])
  p_shapes = jax.eval_shape(model.init, jax.random.key(0))
  p_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), p_shapes)
  b, p, n = spec["batch"], spec["prompt"], spec["new"]
  cache = jax.eval_shape(lambda: model.init_cache(b, p + n))
  engine = JaxEngine(model, None, max_len=p + n, pad_id=0, eos_ids=())
  sampling = SamplingParams(max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=0)
  fn = engine._fn(sampling)  # the engine's jitted prefill + decode loop
  t0 = time.perf_counter()
  toks, mask, lps, _ = jax.eval_shape(
      fn, p_shapes, cache, jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b, p), bool),
      jax.random.key(0))
  assert toks.shape == mask.shape == lps.shape == (b, n)
  count = sum(x.size for x in jax.tree.leaves(p_shapes))
  print(f"mode {args.mode}: {shapes_line(spec)}")
  cache_gib = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) / 2**30
  print(f"opdjax params: {count / 1e9:.3f}B; KV cache {cache_gib:.2f} GiB")
  print(f"prefill + decode loop traced at full size in {time.perf_counter() - t0:.1f}s")


def report(args, spec, results: list[dict]) -> None:
  jx, hf = results
  new_tokens = spec["batch"] * spec["new"]
  cpu = args.mode == "cpu"
  header = ["side", "median call (s)", "new tokens/s"] + (["new tokens/s (CPU time)"] if cpu else [])
  header += ["first call (s)"]
  rows = []
  for r in results:
    row = [r["side"], f"{r['call_s']:.3f}", f"{new_tokens / r['call_s']:,.0f}"]
    row += [f"{new_tokens / r['cpu_call_s']:,.0f}"] if cpu else []
    rows.append(row + [f"{r['first_call_s']:.1f}"])
  speedup = hf["call_s"] / jx["call_s"]
  cpu_speedup = hf["cpu_call_s"] / jx["cpu_call_s"]
  summary = {
      "bench": "rollout", "mode": args.mode, "threads": args.threads if cpu else None,
      "new_tokens_per_call": new_tokens,
      "opdjax_tokens_per_s": round(new_tokens / jx["call_s"], 1),
      "hf_generate_tokens_per_s": round(new_tokens / hf["call_s"], 1),
      "speedup": round(speedup, 3),
      "cpu_time_speedup": round(cpu_speedup, 3) if cpu else None,
  }
  table = _common.markdown_table(header, rows)
  ratio_line = (f"opdjax JaxEngine / HF generate: {speedup:.2f}x tokens/s"
                + (f" ({cpu_speedup:.2f}x in CPU time)" if cpu else ""))
  notes = [
      f"Shapes: {shapes_line(spec)}",
      f"tokens/s = batch x new tokens ({new_tokens}) / median wall time of one call (prefill included);"
      " first call = opdjax compile + run, HF warm-up run",
      ("Same weights (opdjax init exported with save_hf_params)" if args.share_weights else
       "Independent random weights on each side") + "; sampling at temperature 1, no top-k / top-p, no EOS",
      f"opdjax: {jx['framework']}; HF: {hf['framework']}",
      *([_common.CPU_TIME_NOTE] if cpu else []),
  ]
  _common.report("Rollout", args, jx["device"], notes, table, ratio_line, summary)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mode", choices=sorted(MODES), default="cpu")
  ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                  help="cpu mode: cores each side is pinned to (default: all available)")
  ap.add_argument("--share-weights", action=argparse.BooleanOptionalAction, default=True,
                  help="export opdjax's init for HF to load (default); off: each side builds random weights")
  ap.add_argument("--out", help="append a markdown section to this file")
  ap.add_argument("--machine", help="machine description for --out")
  ap.add_argument("--dry-run", action="store_true", help="param count and a full-size trace only")
  ap.add_argument("--side", choices=("jax", "torch"), help=argparse.SUPPRESS)
  ap.add_argument("--weights-dir", help=argparse.SUPPRESS)
  args = ap.parse_args()
  spec = MODES[args.mode]

  if args.side:
    if args.mode == "cpu":
      _common.pin_cpu_threads(args.threads)
    _common.emit((jax_side if args.side == "jax" else torch_side)(args, spec))
    return
  if args.dry_run:
    dry_run(args, spec)
    return
  env = {"JAX_PLATFORMS": "cpu"} if args.mode == "cpu" else {}
  with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
    child_args = ["--mode", args.mode, "--threads", str(args.threads),
                  "--weights-dir", os.path.join(tmp, "model"),
                  "--share-weights" if args.share_weights else "--no-share-weights"]
    results = [_common.run_child(__file__, child_args + ["--side", side], env) for side in ("jax", "torch")]
  report(args, spec, results)


if __name__ == "__main__":
  sys.exit(main())
