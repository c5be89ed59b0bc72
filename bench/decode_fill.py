"""Decode step time against KV-cache fill: does a decode step cost what the tokens so far cost, or
what the preallocated cache costs?

One jitted function runs `steps` engine decode steps (`opdjax.rollout.jax.engine.decode_step` over the
weights as the engine installs them, one new token per row, greedy) from a cache of `max_len` slots
filled to `fill` x max_len; it is called at 10% and at 90% fill (the fill is an argument: one compile).
A decode step that reads only the filled cache gets cheaper at 10%; one that reads every slot costs the
same at both (the XLA decode attention today: opdjax.models.kv_cache).

    PYTHONPATH=. python bench/decode_fill.py                # CPU: small model, ~1 min
    PYTHONPATH=. python bench/decode_fill.py --mode gpu     # Qwen3-0.6B shape, bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

MODES = {
    "cpu": {"model": dict(hidden=256, layers=4, heads=4, kv=2, head_dim=64, inter=768), "vocab": 8192,
            "batch": 8, "max_len": 4096, "steps": 16, "repeats": 3, "dtype": "float32"},
    "gpu": {"model": dict(hidden=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072), "vocab": 151936,
            "batch": 64, "max_len": 4096, "steps": 32, "repeats": 3, "dtype": "bfloat16"},
}
FILLS = (0.1, 0.9)


def model_config(spec: dict):
  from opdjax.models import ModelConfig
  m = spec["model"]
  return ModelConfig(
      model_type="qwen3", vocab_size=spec["vocab"], hidden_size=m["hidden"], intermediate_size=m["inter"],
      num_layers=m["layers"], num_heads=m["heads"], num_kv_heads=m["kv"], head_dim=m["head_dim"],
      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960,
      dtype=spec["dtype"])


def shapes_line(spec: dict) -> str:
  m = spec["model"]
  return (f"qwen3 hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads / {m['kv']} kv heads, head_dim"
          f" {m['head_dim']}, vocab {spec['vocab']}, {spec['dtype']}; batch {spec['batch']}, KV cache of"
          f" {spec['max_len']} slots; {spec['steps']} decode steps per call, median of {spec['repeats']} calls")


def decode_loop(model, steps: int):
  """`(prepared, cache, tokens [B], positions [B], start [B]) -> (tokens, cache)` after `steps` greedy
  decode steps from `cache["index"]` (`prepared`: `install_params`' weights)."""
  import jax
  import jax.numpy as jnp

  from opdjax.rollout.jax.engine import decode_step

  def run(prepared, cache, tok, pos, start):
    def body(_, carry):
      cache, tok, pos = carry
      logits, cache = decode_step(prepared, cache, tok, pos, start, model=model)
      return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), pos + 1

    cache, tok, _ = jax.lax.fori_loop(0, steps, body, (cache, tok, pos))
    return tok, cache

  return jax.jit(run, donate_argnums=1)


def measure(model, params, spec: dict, fills=FILLS) -> dict:
  """Per-step wall and CPU milliseconds at each fill, and the compile seconds."""
  import jax
  import jax.numpy as jnp

  b, s, steps = spec["batch"], spec["max_len"], spec["steps"]
  fn = decode_loop(model, steps)
  cache = model.init_cache(b, s)
  tok = jnp.zeros((b,), jnp.int32)
  out = {"compile_s": None}
  zero = jnp.zeros((b,), jnp.int32)
  for fill in fills:
    start = int(fill * s)
    pos = jnp.full((b,), start, jnp.int32)

    def call(cache, start=start, pos=pos):
      toks, cache = fn(params, {**cache, "index": jnp.asarray(start, jnp.int32)}, tok, pos, zero)
      jax.block_until_ready(toks)
      return cache

    wall, _, cache = _common.timed(lambda c=cache: call(c))
    if out["compile_s"] is None:
      out["compile_s"] = wall
    walls, cpus = [], []
    for _ in range(spec["repeats"]):
      wall, cpu, cache = _common.timed(lambda c=cache: call(c))
      walls.append(wall)
      cpus.append(cpu)
    out[f"step_ms_{round(fill * 100)}pct"] = statistics.median(walls) / steps * 1e3
    out[f"cpu_step_ms_{round(fill * 100)}pct"] = statistics.median(cpus) / steps * 1e3
  lo, hi = (f"{round(f * 100)}pct" for f in fills)
  out["ratio"] = out[f"step_ms_{lo}"] / out[f"step_ms_{hi}"]
  out["cpu_ratio"] = out[f"cpu_step_ms_{lo}"] / out[f"cpu_step_ms_{hi}"]
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mode", choices=sorted(MODES), default="cpu")
  ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="cpu mode: cores to use")
  args = ap.parse_args()
  spec = MODES[args.mode]
  if args.mode == "cpu":
    _common.pin_cpu_threads(args.threads)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from opdjax.models import Model
  from opdjax.rollout.jax.engine import install_params

  model = Model(model_config(spec))
  params = jax.jit(lambda k: install_params(model.init(k), model))(jax.random.key(0))
  t0 = time.perf_counter()
  res = measure(model, params, spec)
  print(f"{shapes_line(spec)} ({jax.devices()[0].device_kind}, {time.perf_counter() - t0:.0f} s)")
  for fill in FILLS:
    p = f"{round(fill * 100)}pct"
    print(f"  fill {fill:.0%}: {res[f'step_ms_{p}']:.2f} ms/step wall, {res[f'cpu_step_ms_{p}']:.2f} ms/step CPU time")
  print(f"  10% / 90% fill step time: {res['ratio']:.3f} wall, {res['cpu_ratio']:.3f} CPU time")
  print(json.dumps({"bench": "decode_fill", "mode": args.mode, **{k: round(v, 4) for k, v in res.items()}}))


if __name__ == "__main__":
  main()
