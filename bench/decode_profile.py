"""Where a JaxEngine decode step spends its time: the experiment BENCHMARKS.md's GPU suite section
asks for, after the H200 measured the engine's decode step several times its memory floor.

Three measurements, one process, the rollout bench's shapes (bench/rollout.py MODES):
- `JaxEngine.generate` at the bench's batch and at 4x and 1/4x it, sampled (temperature 1) and greedy,
  with `max_new_tokens` N and 1: (call(N) - call(1)) / (N - 1) is the decode step alone, prefill apart.
  A step time flat in the batch is a fixed per-step cost; one that grows with it is the work.
- The decode step's bytes at each batch (weights once, the KV cache's mean fill), so each step has its
  memory floor beside it.
- A `jax.profiler` trace of one sampled call of 32 new tokens at the bench's batch
  (`create_perfetto_trace`): device time summed by op name, the top ops printed and kept in the JSON
  (the trace itself is written to OUT).

    PYTHONPATH=. python bench/decode_profile.py --mode cpu    # the code paths on tiny shapes (~1 min)
    PYTHONPATH=. python bench/decode_profile.py --mode gpu    # one GPU, CUDA jax: ~2 min
Writes `$OUT/decode_profile.json` (OUT set) or bench/results/decode_profile.json, and prints it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import rollout  # noqa: E402

HBM_COPY_TB_S = 4.3  # an H200's device-to-device copy as measured on the lent machines (the device tool's KINDS.md)
BATCH_FACTORS = (0.25, 1, 4)
TRACE_NEW = 32  # new tokens of the traced call


def _width(spec: dict) -> int:
  return 2 if spec["dtype"] == "bfloat16" else 4


def param_count(spec: dict) -> int:
  """A tied-embedding Qwen3-shaped model's parameters (norms left out: they are a rounding error)."""
  m = spec["model"]
  attn = 2 * m["hidden"] * m["heads"] * m["head_dim"] + 2 * m["hidden"] * m["kv"] * m["head_dim"]
  return spec["vocab"] * m["hidden"] + m["layers"] * (attn + 3 * m["hidden"] * m["inter"])


def weight_bytes(spec: dict) -> float:
  return _width(spec) * param_count(spec)


def kv_bytes(spec: dict, batch: int) -> float:
  """The KV cache a decode step must read at its mean fill (the prompt and half the new tokens), every layer."""
  m = spec["model"]
  return batch * (spec["prompt"] + spec["new"] / 2) * m["layers"] * 2 * m["kv"] * m["head_dim"] * _width(spec)


def step_bytes(spec: dict, batch: int) -> float:
  """Bytes a decode step must read: every weight once (in the compute dtype) and the KV cache's mean fill."""
  return weight_bytes(spec) + kv_bytes(spec, batch)


def timed_calls(engine, prompts, sampling, repeats: int) -> float:
  import jax

  def call(seed):
    jax.block_until_ready(engine.generate(prompts, sampling, seed=seed).completion_tokens)

  call(0)  # compile
  walls = []
  for i in range(repeats):
    t0 = time.perf_counter()
    call(i + 1)
    walls.append(time.perf_counter() - t0)
  return statistics.median(walls)


def op_group(name: str) -> str:
  """An XLA GPU kernel's kind, by its name: copies (memcpy, dynamic-slice and dynamic-update-slice fusions),
  matmuls (XLA's gemm fusions, cuBLAS / nvjet kernels), attention (cuDNN) or other (elementwise, reductions)."""
  if name.startswith(("memcpy", "copy")) or "dynamic_slice" in name or "dynamic_update_slice" in name:
    return "copies"
  if any(k in name for k in ("gemm", "nvjet", "cublas", "dot")):
    return "matmuls"
  return "attention" if "sdpa" in name or "cudnn" in name else "other"


def device_ops(trace: str, top: int = 25) -> dict:
  """A perfetto trace's complete events (the file, or the first perfetto_trace.json.gz under a folder) summed
  by name and by `op_group`, on the device's tracks (GPU streams) when there are any, else every track."""
  path = [trace] if os.path.isfile(trace) else glob.glob(os.path.join(trace, "**", "perfetto_trace.json.gz"),
                                                          recursive=True)
  if not path:
    return {"error": f"no perfetto_trace.json.gz under {trace}"}
  with gzip.open(path[0], "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  pname = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device_pids = {p for p, n in pname.items() if "GPU" in n.upper() and "HOST" not in n.upper()}
  sums, counts, groups = collections.Counter(), collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and (not device_pids or e.get("pid") in device_pids):
      sums[e["name"]] += e.get("dur", 0) / 1e3
      counts[e["name"]] += 1
      groups[op_group(e["name"])] += e.get("dur", 0) / 1e3
  return {"tracks": sorted(pname[p] for p in device_pids) or ["every track (no device track found)"],
          "all_tracks": sorted(set(pname.values())),
          "total_ms": round(sum(sums.values()), 3), "kernels": sum(counts.values()),
          "groups_ms": {g: round(ms, 3) for g, ms in groups.most_common()},
          "ops": [[n, round(ms, 3), counts[n]] for n, ms in sums.most_common(top)], "file": path[0]}


def markdown(rep: dict) -> str:
  """BENCHMARKS.md's table and paragraph (and this bench's printout): each batch's decode step against its
  memory floor, then where the traced call's kernel time went."""
  rows = [[str(w["batch"]), f"{w['sampled']['decode_step_ms']:.2f}", f"{w['greedy']['decode_step_ms']:.2f}",
           f"{w['floor_ms']:.2f}", f"{w['sampled']['x_floor']:.1f}x", f"{w['new_tokens_per_s']:,}"]
          for w in rep["rows"]]
  head = ["batch", "decode step, sampled (ms)", "greedy (ms)", "memory floor (ms)", "step / floor",
          "new tokens/s (sampled call)"]
  p = rep["profile"]
  share = ", ".join(f"{g} {ms / p['total_ms']:.0%}" for g, ms in p["groups_ms"].items())
  return (_common.markdown_table(head, rows) + f"\n\nKernels of the traced call: {p['total_ms']:.1f} ms of GPU kernels"
          f" for a call of {p['new_tokens']} new tokens at batch {p['batch']} ({p['kernels']:,} kernels, about"
          f" {_kernels_a_step(p):.0f} a step): {share}.")


def _kernels_a_step(profile: dict) -> float:
  """The traced call's kernels over its forward passes (the prefill and one a new token)."""
  return profile["kernels"] / (profile["new_tokens"] + 1)


def layers_table(runs: dict) -> str:
  """Two runs of one call, {"scan": rep, "unrolled": rep (`--unroll-layers`)}, side by side."""
  traced = runs["scan"]["profile"]["new_tokens"]
  head = ["decoder layers", "decode step, sampled (ms)", "greedy (ms)", "step / floor", "kernels a step",
          *(f"{k} in the traced call of {traced} tokens (ms)" for k in ("copies", "matmuls", "other")),
          "the run's wall (s)"]
  rows = []
  for v, label in (("scan", "one scan (as shipped)"), ("unrolled", "unrolled (`--unroll-layers`)")):
    w, p = runs[v]["rows"][0], runs[v]["profile"]
    g = p["groups_ms"]
    rows.append([label, f"{w['sampled']['decode_step_ms']:.2f}", f"{w['greedy']['decode_step_ms']:.2f}",
                 f"{w['sampled']['x_floor']:.1f}x", f"{_kernels_a_step(p):.0f}",
                 f"{g['copies']:.1f}", f"{g['matmuls']:.1f}", f"{g['other']:.1f}", f"{runs[v]['wall_s']:.0f}"])
  return _common.markdown_table(head, rows)


def floor(suite: dict) -> str:
  """bench/gpu_suite.py's engine decode step against the bytes it must read each step (every weight once, the KV
  cache's mean fill) at HBM_COPY_TB_S: how far the step is from memory-bound."""
  spec = rollout.MODES["gpu"]  # the suite's engine part ran these shapes; its record must name them
  if rollout.shapes_line(spec) != suite["rollout"]["shapes"]:
    raise ValueError("gpu_suite.json's rollout shapes are not rollout.MODES['gpu'] any more: compute its floor from"
                     f" the shapes it ran ({suite['rollout']['shapes']})")
  weights_gb, kv_gb = weight_bytes(spec) / 1e9, kv_bytes(spec, spec["batch"]) / 1e9
  bw, new = HBM_COPY_TB_S, spec["new"]
  floor_ms, step_ms = (weights_gb + kv_gb) / bw, 1e3 * suite["rollout"]["opdjax"]["call_s"] / new
  fp8_saving = weights_gb / 2 / bw
  return (f"{step_ms:.2f} ms a decode step (a call over its {new} new tokens, prefill included), against a"
          f" memory floor of {floor_ms:.2f} ms: {weights_gb:.2f} GB of bf16 weights ({param_count(spec) / 1e6:.0f}M"
          f" parameters) and on average {kv_gb:.2f} GB of KV cache ({spec['batch']} rows, {spec['prompt']} + {new}/2"
          f" positions) read once at {bw} TB/s, {step_ms / floor_ms:.1f}x off it. FP8 weights save at most"
          f" {fp8_saving:.2f} ms of that step ({fp8_saving / step_ms:.0%}); the measured W8A8 engine ran at"
          f" {suite['engine_decode']['fp8_w8a8_speedup']:.2f}x bf16")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mode", choices=sorted(rollout.MODES), default="cpu")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--batch-factors", default=",".join(map(str, BATCH_FACTORS)),
                  help="the batches to time, as multiples of the rollout bench's batch")
  ap.add_argument("--unroll-layers", action="store_true",
                  help="the training decoder's layers as straight-line code (Model(unroll_layers=True)): the"
                       " experiment that showed the stacked cache's slices were not the scan's doing; the engine's"
                       " decode layers are straight-line code over per-layer weights and cache since")
  args = ap.parse_args()
  spec = rollout.MODES[args.mode]
  if args.mode == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp

  from opdjax.models import Model
  from opdjax.rollout import JaxEngine, SamplingParams

  if args.mode == "gpu" and jax.default_backend() != "gpu":
    raise SystemExit(f"--mode gpu needs a CUDA jax; jax.default_backend() is {jax.default_backend()!r}.")
  t_start = time.perf_counter()
  model = Model(rollout.model_config(spec), unroll_layers=args.unroll_layers)
  params = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(jnp.dtype(spec["dtype"])), model.init(k)))(
      jax.random.key(0))
  n = spec["new"]
  rep = {"bench": "decode_profile", "mode": args.mode, "machine": _common.machine(),
         "device": jax.devices()[0].device_kind,
         "jax": jax.__version__, "shapes": rollout.shapes_line(spec), "unroll_layers": args.unroll_layers, "rows": []}
  for factor in (float(f) for f in args.batch_factors.split(",")):
    batch = max(1, int(spec["batch"] * factor))
    prompts = rollout.make_prompts({**spec, "batch": batch})
    engine = JaxEngine(model, params, max_len=spec["prompt"] + n, pad_id=0, eos_ids=())
    row = {"batch": batch}
    for kind, temp in (("sampled", 1.0), ("greedy", 0.0)):
      full = timed_calls(engine, prompts, SamplingParams(max_new_tokens=n, temperature=temp), args.repeats)
      one = timed_calls(engine, prompts, SamplingParams(max_new_tokens=1, temperature=temp), args.repeats)
      row[kind] = {"call_s": round(full, 4), "prefill_call_s": round(one, 4),
                   "decode_step_ms": round(1e3 * (full - one) / (n - 1), 3)}
    floor_ms = 1e3 * step_bytes(spec, batch) / (HBM_COPY_TB_S * 1e12)
    row["floor_ms"] = round(floor_ms, 3)
    row["sampled"]["x_floor"] = round(row["sampled"]["decode_step_ms"] / floor_ms, 2)
    row["new_tokens_per_s"] = round(batch * n / row["sampled"]["call_s"])
    rep["rows"].append(row)
    print(json.dumps(row), flush=True)
    del engine

  out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  os.makedirs(out_dir, exist_ok=True)
  prompts = rollout.make_prompts(spec)
  engine = JaxEngine(model, params, max_len=spec["prompt"] + n, pad_id=0, eos_ids=())
  sampling = SamplingParams(max_new_tokens=TRACE_NEW, temperature=1.0)  # a short call: a small trace
  timed_calls(engine, prompts, sampling, 1)
  trace_dir = tempfile.mkdtemp(prefix="decode-profile-")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    jax.block_until_ready(engine.generate(prompts, sampling, seed=7).completion_tokens)
  prof = device_ops(trace_dir)
  if "file" in prof:
    shutil.copy(prof.pop("file"), os.path.join(out_dir, "decode_profile_trace.json.gz"))
  rep["profile"] = {"batch": spec["batch"], "new_tokens": TRACE_NEW, **prof}
  rep["wall_s"] = round(time.perf_counter() - t_start, 1)
  with open(os.path.join(out_dir, "decode_profile.json"), "w") as f:
    json.dump(rep, f, indent=1)
  for name, ms, count in prof.get("ops", []):
    print(f"{ms:10.3f} ms {count:7d}x  {name[:110]}")
  if "total_ms" in prof:  # a trace was found
    print(markdown(rep))
  print(json.dumps(rep))
  return 0


if __name__ == "__main__":
  sys.exit(main())
