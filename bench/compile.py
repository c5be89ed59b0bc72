"""Compile time against depth: the OPD train step and the JAX engine's generate function, ahead of time.

Lowers and compiles, from abstract params (`jax.eval_shape`, `jax.ShapeDtypeStruct`: nothing is
allocated), on the CPU backend:
- the OPD train step (`make_train_step`, full-vocab reverse KL, AdamW) with a Qwen3-0.6B-shaped
  student (remat on every layer) and a Qwen3-1.7B-shaped teacher, batch 2 x 256 tokens;
- `JaxEngine`'s generate function (prefill + `lax.while_loop` decode) at both shapes, batch 8,
  prompt 128, 128 new tokens;
once with `num_layers=2` and once with `num_layers=28` (the real depth). With the layers scanned
the 28-layer compile should cost about what the 2-layer one does. Each depth runs in its own
subprocess, so neither pays the other's one-time warm-up. Prints one JSON line; `hlo_chars` is the
size of the lowered StableHLO, a noise-free measure of how much the compiler is given, and the
`*_cpu_s` keys the processes' CPU seconds (honest on a machine shared with other jobs).

    PYTHONPATH=. python bench/compile.py      # ~15 s on 2 CPU cores (~45 s with unrolled layers)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _common

STUDENT, TEACHER = "qwen3-0.6b", "qwen3-1.7b"
TRAIN = dict(batch=2, seq=256)
GENERATE = dict(batch=8, prompt=128, new_tokens=128)
DEPTHS = (2, 28)


def _model(cfg, remat: bool):
  from opdjax.models import Model

  try:
    return Model(cfg, remat_policy="full" if remat else "nothing")
  except TypeError:  # the unrolled layout before scanned layers took `remat: bool`; kept to measure it
    return Model(cfg, remat=remat)


def _timed_compile(fn, *args) -> dict:
  t0, c0 = time.perf_counter(), time.process_time()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  lowered.compile()
  t2, c2 = time.perf_counter(), time.process_time()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "cpu_s": c2 - c0, "hlo_chars": len(lowered.as_text())}


def train_step_compile(layers: int) -> dict:
  import jax
  import jax.numpy as jnp

  from opdjax.analyses.capacity import load_model_config
  from opdjax.training.loss import LossConfig
  from opdjax.training.step import OptimConfig, TrainState, make_optimizer, make_train_step

  scfg = load_model_config(STUDENT)[1].replace(num_layers=layers)
  tcfg = load_model_config(TEACHER)[1].replace(num_layers=layers)
  student, teacher = _model(scfg, remat=True), _model(tcfg, remat=False)
  optimizer = make_optimizer(OptimConfig())
  params = jax.eval_shape(student.init, jax.random.key(0))
  state = jax.eval_shape(lambda p: TrainState.create(p, optimizer), params)
  teacher_params = jax.eval_shape(teacher.init, jax.random.key(1))
  b, t = TRAIN["batch"], TRAIN["seq"]
  i32, f32 = jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.float32)
  batch = {"tokens": i32, "targets": i32, "positions": i32, "attention_mask": i32, "loss_mask": f32,
           "rollout_logprobs": f32}
  step = make_train_step(student, teacher, LossConfig(kind="full_rkl"), optimizer)
  return _timed_compile(step, state, teacher_params, batch)


def generate_compile(shape: str, layers: int) -> dict:
  import jax
  import jax.numpy as jnp

  from opdjax.analyses.capacity import load_model_config
  from opdjax.rollout import JaxEngine, SamplingParams

  model = _model(load_model_config(shape)[1].replace(num_layers=layers), remat=False)
  params = jax.eval_shape(model.init, jax.random.key(0))
  b, p, n = GENERATE["batch"], GENERATE["prompt"], GENERATE["new_tokens"]
  engine = JaxEngine(model, params, max_len=p + n, pad_id=0, eos_ids=(1,))
  cache = jax.eval_shape(lambda: model.init_cache(b, p + n))
  key = jax.eval_shape(lambda: jax.random.key(0))
  # The engine's own jitted function (what `generate` calls), lowered against abstract arguments.
  fn = engine._fn(SamplingParams(max_new_tokens=n, temperature=1.0))
  return _timed_compile(fn, params, cache, jax.ShapeDtypeStruct((b, p), jnp.int32),
                        jax.ShapeDtypeStruct((b, p), jnp.bool_), key)


def child(layers: int) -> None:
  parts = {"train_step": train_step_compile(layers), f"generate_{STUDENT}": generate_compile(STUDENT, layers),
           f"generate_{TEACHER}": generate_compile(TEACHER, layers)}
  total = sum(v["lower_s"] + v["compile_s"] for v in parts.values())
  _common.emit({"layers": layers, "total_s": total, "cpu_s": sum(v["cpu_s"] for v in parts.values()),
                "parts": parts})


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--child-layers", type=int, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child_layers:
    child(args.child_layers)
    return
  env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get(
      "PYTHONPATH")]))}
  res = {n: _common.run_child(os.path.abspath(__file__), ["--child-layers", str(n)], env) for n in DEPTHS}
  lo, hi = (res[n]["total_s"] for n in DEPTHS)
  summary = {f"layers_{DEPTHS[0]}_s": round(lo, 2), f"layers_{DEPTHS[1]}_s": round(hi, 2), "ratio": round(hi / lo, 3)}
  # Process CPU seconds: jobs sharing the machine slow the wall clock, not the compiler's work.
  lo_cpu, hi_cpu = (res[n]["cpu_s"] for n in DEPTHS)
  summary.update({f"layers_{DEPTHS[0]}_cpu_s": round(lo_cpu, 2), f"layers_{DEPTHS[1]}_cpu_s": round(hi_cpu, 2),
                  "cpu_ratio": round(hi_cpu / lo_cpu, 3)})
  for n in DEPTHS:
    for name, part in res[n]["parts"].items():
      summary[f"{name}_{n}_s"] = round(part["lower_s"] + part["compile_s"], 2)
      summary[f"{name}_{n}_hlo_chars"] = part["hlo_chars"]
  json.dump(summary, sys.stdout)
  print()


if __name__ == "__main__":
  main()
