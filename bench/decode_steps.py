"""The engine's decode step against its memory floor, per batch and number format: the measurement the
decode-floor issue asks of one GPU (bench/gpu_suite.py's `decode` part runs it; on CPU it checks itself).

For each variant (bf16; fp8 KV cache; fp8 KV cache + W8A16 weights; fp8 KV cache + W8A8 on FP8 GEMMs)
and batch, one jitted `fori_loop` of `steps` engine decode steps (bench/decode_fill.py's `decode_loop`:
greedy, the cache donated) from a cache filled to the rollout's mean fill (prompt + new / 2 of prompt +
new slots). Reported: compile seconds, the step's wall milliseconds (median of `repeats` calls / steps),
new tokens/s (batch / step), the step's memory floor (every weight once in its stored width, plus the
KV cache's mean fill; and plus the whole cache, which the XLA attention reads today) at the H200's copy
bandwidth, the step as a multiple of each, and on a GPU the kernels a step launches (a profiler trace).

    PYTHONPATH=. python bench/decode_steps.py --mode cpu     # tiny shapes, the code paths (~1 min)
    PYTHONPATH=. python bench/decode_steps.py --mode gpu     # one H200: the rollout bench's Qwen3-0.6B shape
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_fill  # noqa: E402
import decode_profile  # noqa: E402
import rollout  # noqa: E402

VARIANTS = {  # model-config switches, and whether the layer matrices are packed fp8 (per channel)
    "bf16": ({}, False),
    "fp8_kv": ({"kv_quant": "fp8_e4m3"}, False),
    "fp8_kv_w8a16": ({"kv_quant": "fp8_e4m3"}, True),
    "fp8_kv_w8a8": ({"kv_quant": "fp8_e4m3", "act_quant": "fp8_e4m3", "fp8_matmul": True}, True),
}
BATCHES = {"gpu": (16, 64, 256), "cpu": (2, 4)}
SPECS = {"gpu": {**rollout.MODES["gpu"], "steps": 32, "repeats": 3},
         "cpu": {**rollout.MODES["cpu"], "model": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=128),
                 "vocab": 512, "prompt": 16, "new": 16, "steps": 4, "repeats": 2}}


def shapes_line(spec: dict) -> str:
  m = spec["model"]
  return (f"hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv']} kv heads, head_dim"
          f" {m['head_dim']}, intermediate {m['inter']}, tied embeddings, vocab {spec['vocab']}; a cache of prompt"
          f" {spec['prompt']} + {spec['new']} new slots; {spec['dtype']} compute; median of {spec['repeats']} calls")


def floor_bytes(spec: dict, batch: int, variant: str) -> dict:
  """Bytes a decode step must read: every weight once as stored (the layer matrices 1 byte with fp8
  weights; embeddings in the compute dtype), and the KV cache (1 byte a value + a 4-byte scale per
  token and head when fp8) at its mean fill, or whole."""
  m, (switches, packed) = spec["model"], VARIANTS[variant]
  width = 2 if spec["dtype"] == "bfloat16" else 4
  layer_params = m["layers"] * (2 * m["hidden"] * m["heads"] * m["head_dim"] + 2 * m["hidden"] * m["kv"] * m["head_dim"]
                                + 3 * m["hidden"] * m["inter"])
  weights = spec["vocab"] * m["hidden"] * width + layer_params * (1 if packed else width)
  per_token = m["layers"] * 2 * m["kv"] * (m["head_dim"] * (1 if switches.get("kv_quant") else width)
                                           + (4 if switches.get("kv_quant") else 0))
  slots = spec["prompt"] + spec["new"]
  return {"weights": weights, "kv_mean_fill": batch * (spec["prompt"] + spec["new"] / 2) * per_token,
          "kv_whole": batch * slots * per_token}


def build(spec: dict, variant: str, batch: int, params=None, abstract: bool = False):
  """`(model, loop, prepared, cache)` for one variant at one batch (abstract: ShapeDtypeStructs only)."""
  import jax

  from opdjax.models import Model
  from opdjax.rollout.jax.engine import install_params
  from opdjax.views import perturb

  switches, packed = VARIANTS[variant]
  model = Model(rollout.model_config(spec).replace(**switches))
  recipe = perturb.preset("fp8", model.cfg.num_layers, keep_edge_layers=0)
  raw = params if params is not None else jax.eval_shape(model.init, jax.random.key(0))
  prep = lambda p: install_params(perturb.apply_recipe(p, recipe, pack=True) if packed else p, model)
  prepared = jax.eval_shape(prep, raw) if abstract else jax.jit(prep)(raw)
  slots = spec["prompt"] + spec["new"]
  cache = jax.eval_shape(lambda: model.init_cache(batch, slots)) if abstract else model.init_cache(batch, slots)
  return model, decode_fill.decode_loop(model, spec["steps"]), prepared, cache


def compile_one(spec: dict, variant: str, batch: int):
  """`(compiled, seconds)`: one (variant, batch) program compiled from abstract values."""
  import jax
  import jax.numpy as jnp

  _, loop, prepared, cache = build(spec, variant, batch, abstract=True)
  row = jax.ShapeDtypeStruct((batch,), jnp.int32)
  t0 = time.perf_counter()
  compiled = loop.lower(prepared, cache, row, row, row).compile()
  return compiled, round(time.perf_counter() - t0, 2)


def compile_all(spec: dict, pairs, workers: int | None = None) -> dict:
  """Every planned program compiled first, in parallel threads (XLA compiles outside the GIL; on the
  GPU host 16 cores), each one's seconds printed as a `COMPILED` row when it is done: a time limit
  that ends the measuring still leaves what the compiles cost, and a rerun loads them from the
  persistent cache. `{(variant, batch): (compiled, seconds)}`."""
  import concurrent.futures

  workers = workers or max(1, min(len(pairs), os.cpu_count() or 1))
  out = {}
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {pool.submit(compile_one, spec, v, b): (v, b) for v, b in pairs}
    for fut in concurrent.futures.as_completed(futures):
      v, b = futures[fut]
      out[(v, b)] = fut.result()
      print("COMPILED " + json.dumps({"variant": v, "batch": b, "compile_s": out[(v, b)][1]}), flush=True)
  return out


def measure(spec: dict, variant: str, batch: int, params, trace: bool, compiled=None) -> dict:
  """One row; `compiled`: `(program, seconds)` from `compile_all` (else compiled here)."""
  import jax
  import jax.numpy as jnp

  _, _, prepared, cache = build(spec, variant, batch, params)
  if compiled is None:
    compiled = compile_one(spec, variant, batch)
  compiled, compile_s = compiled
  out = {"variant": variant, "batch": batch, "compile_s": compile_s}
  fill = spec["prompt"] + spec["new"] // 2
  row = jnp.zeros((batch,), jnp.int32)
  pos = jnp.full((batch,), fill, jnp.int32)

  def call(cache):
    tok, cache = compiled(prepared, {**cache, "index": jnp.asarray(fill, jnp.int32)}, row, pos, row)
    jax.block_until_ready(tok)
    return cache

  cache = call(cache)  # warm-up
  walls = []
  for _ in range(spec["repeats"]):
    t0 = time.perf_counter()
    cache = call(cache)
    walls.append(time.perf_counter() - t0)
  step_s = statistics.median(walls) / spec["steps"]
  floor = floor_bytes(spec, batch, variant)
  bw = decode_profile.HBM_COPY_TB_S * 1e12
  floor_s, whole_s = ((floor["weights"] + floor[kv]) / bw for kv in ("kv_mean_fill", "kv_whole"))
  out.update(step_ms=round(1e3 * step_s, 4), new_tokens_per_s=round(batch / step_s),
             floor_ms=round(1e3 * floor_s, 4), floor_whole_cache_ms=round(1e3 * whole_s, 4),
             x_floor=round(step_s / floor_s, 2), x_floor_whole_cache=round(step_s / whole_s, 2))
  out["kernels_per_step"] = None
  if trace and jax.default_backend() == "gpu":
    trace_dir = tempfile.mkdtemp(prefix="decode-steps-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      cache = call(cache)
    prof = decode_profile.device_ops(trace_dir)
    if "kernels" in prof:
      out["kernels_per_step"] = round(prof["kernels"] / spec["steps"], 1)
      out["kernel_groups_ms_per_step"] = {g: round(ms / spec["steps"], 4) for g, ms in prof["groups_ms"].items()}
  return out


def plan(batches, variants=tuple(VARIANTS), w8a8_batches=None) -> list[tuple[str, int]]:
  """(variant, batch) pairs: every variant at every batch, W8A8 (a large-batch choice) only at `w8a8_batches`."""
  return [(v, b) for v in variants for b in batches
          if v != "fp8_kv_w8a8" or w8a8_batches is None or b in w8a8_batches]


# The rows that decide the decode targets first (batch 64 bf16: tokens/s and x floor; fp8 KV + W8A16
# against it; batch 256 bf16), then the rest of bf16 / fp8 KV / fp8 KV + W8A16 at 16, 64 and 256: a part
# cut short keeps the rows it printed, so the order is the priority.
TARGET_PLAN = [("bf16", 64), ("fp8_kv_w8a16", 64), ("bf16", 256), ("fp8_kv", 64), ("fp8_kv_w8a16", 256),
               ("fp8_kv", 256), ("bf16", 16), ("fp8_kv", 16), ("fp8_kv_w8a16", 16)]


def lower_all(spec: dict, pairs) -> dict:
  """Every (variant, batch) program lowered at full size on abstract values (a dry run)."""
  import jax
  import jax.numpy as jnp

  out = {}
  for variant, b in pairs:
    _, loop, prepared, cache = build(spec, variant, b, abstract=True)
    row = jax.ShapeDtypeStruct((b,), jnp.int32)
    t0 = time.perf_counter()
    loop.lower(prepared, cache, row, row, row)
    out[f"{variant}@{b}"] = {"lower_s": round(time.perf_counter() - t0, 2),
                             "floor_bytes": floor_bytes(spec, b, variant)}
  return out


def run_all(spec: dict, pairs, trace_batch: int | None = None) -> list[dict]:
  """Compiles every program first (`compile_all`), then measures them in plan order, printing each
  row as a `ROW` line when it is done (bench/gpu_suite.py keeps those of a part that runs out of time)."""
  import jax

  from opdjax.models import Model

  programs = compile_all(spec, pairs)
  params = jax.jit(Model(rollout.model_config(spec)).init)(jax.random.key(0))
  rows = []
  for variant, b in pairs:
    rows.append(measure(spec, variant, b, params, trace=b == trace_batch, compiled=programs.pop((variant, b))))
    print("ROW " + json.dumps(rows[-1]), flush=True)
  return rows


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mode", choices=sorted(SPECS), default="cpu")
  ap.add_argument("--dry-run", action="store_true", help="lower every program at full size, run nothing")
  args = ap.parse_args()
  spec = SPECS[args.mode]
  if args.mode == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  batches = BATCHES[args.mode]
  if args.dry_run:
    print(json.dumps(lower_all(spec, plan(batches)), indent=1))
    return 0
  rows = run_all(spec, plan(batches), trace_batch=batches[min(1, len(batches) - 1)])
  print(json.dumps({"bench": "decode_steps", "mode": args.mode, "shapes": shapes_line(spec), "rows": rows}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
