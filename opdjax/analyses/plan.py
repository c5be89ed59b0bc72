"""`opdjax plan`: will a teacher -> student OPD run fit, per device, on a given mesh?

Ahead of time (maxtext's train_compile): the OPD train step and the JAX engine's generate function
are lowered and compiled for `--devices` fake host devices (a subprocess with JAX_NUM_CPU_DEVICES),
from abstract params (`jax.eval_shape`, `ShapeDtypeStruct`s carrying the partition rules'
shardings): nothing is allocated. Per device, `compiled.memory_analysis()` gives the arguments
(split here into student params, optimizer state, teacher params, batch / KV cache from their
shapes and shardings), the outputs, the temporaries (activations, gradients, logits chunks) and
what donation aliases; the peak is arguments + outputs + temporaries - aliased.

`--teacher-serve vllm` (teacher.serve='vllm'): the teacher is scored by its own vLLM server(s), so the
train step holds no teacher params and takes the server's answer in its batch (the sampled token's
log-prob, and for topk_rkl the top-K ids and log-probs); the step with the teacher in the trainer is
compiled beside it, so the saving is read off one plan.

The numbers are XLA's CPU backend's. A GPU compile of the same program fuses and lays out
differently (cuDNN attention, its own buffer assignment), so treat them as an estimate with a
margin: the default `--headroom 0.9` counts a device as fitting when the peak is under 90 % of
`--hbm-gib` (141 for an H200, 80 for an H100).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Plan:
  teacher: str
  student: str
  devices: int
  mesh: tuple[int, int, int]  # data, fsdp, tensor; -1 = the rest
  batch: int = 64
  seq_len: int = 1024
  prompt_len: int = 512
  loss: str = "full_rkl"
  chunk: int = 128
  dtype: str = "bfloat16"
  remat: str = "full"
  layers: int = 0  # 0: the models' own depth; N: both models cut to N layers (faster compiles)
  teacher_serve: str = "trainer"  # teacher.serve: "vllm" plans the trainer of a served teacher
  topk: int = 16  # loss.topk (topk_rkl)
  micro_batches: int = 1  # train.micro_batches: the step's gradient accumulated over that many micro-batches

  def __post_init__(self):
    from opdjax.config.schema import placement_refusal, teacher_placement_of
    from opdjax.config.sections import TEACHER_SERVE
    from opdjax.errors import UserError
    from opdjax.training.loss import LossConfig

    if self.micro_batches < 1 or self.batch % self.micro_batches:
      raise UserError(f"--micro-batches {self.micro_batches}: give a divisor of --batch {self.batch}.")
    if self.teacher_serve not in TEACHER_SERVE:
      raise UserError(f"--teacher-serve {self.teacher_serve!r}: choose trainer or vllm.")
    # the step is compiled for the placement teacher.serve gives (the rollout's engine does not score the teacher)
    why = placement_refusal(teacher_placement_of(self.teacher_serve), LossConfig(kind=self.loss, topk=self.topk))
    if why is not None:
      raise UserError(f"--teacher-serve {self.teacher_serve} with --loss {self.loss}: {why}")


def parse_mesh(text: str) -> tuple[int, int, int]:
  """'data=2,fsdp=4' -> (2, 4, 1); missing axes are 1."""
  from opdjax.errors import UserError

  sizes = {"data": 1, "fsdp": 1, "tensor": 1}
  for part in filter(None, (p.strip() for p in text.split(","))):
    k, eq, v = part.partition("=")
    if k not in sizes or not eq or not v.lstrip("-").isdigit():
      raise UserError(f"--mesh {text!r}: give axis=size pairs, e.g. 'fsdp=8' or 'data=2,fsdp=4,tensor=2'"
                      " (-1 = the rest of the devices).")
    sizes[k] = int(v)
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


# --- the worker (runs with JAX_NUM_CPU_DEVICES = plan.devices) ---

def _bytes_per_device(tree) -> int:
  import jax
  import numpy as np

  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def _with_shardings(tree, shardings):
  import jax

  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
         "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes}
  out["peak"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
  return out


def measure(plan: Plan) -> dict:
  """Compiles both functions for `plan` (and, for a served teacher, the step with the teacher in the trainer
  beside it: `train_teacher_in_trainer`) and returns per-device bytes (run where jax sees the devices)."""
  import jax
  import jax.numpy as jnp

  from opdjax.analyses.capacity import load_model_config
  from opdjax.config.schema import MeshConfig
  from opdjax.models import Model
  from opdjax.parallel import rules
  from opdjax.parallel.mesh import check_fits, make_mesh
  from opdjax.parallel.placement import Placement
  from opdjax.rollout.base import SamplingParams
  from opdjax.rollout.jax.engine import generate_loop, install_params
  from opdjax.training.step import OptimConfig, TrainState, make_optimizer, train_step_shardings

  if jax.device_count() != plan.devices:
    raise RuntimeError(f"the worker sees {jax.device_count()} devices, the plan wants {plan.devices}")
  cfgs = {}
  for role in ("teacher", "student"):
    name, mc = load_model_config(getattr(plan, role))
    cfgs[role] = mc.replace(dtype=plan.dtype, **({"num_layers": plan.layers} if plan.layers else {}))
  mesh = make_mesh(MeshConfig(*plan.mesh))
  check_fits(mesh, cfgs, {"--batch": plan.batch})
  place = Placement(mesh)
  student, teacher = (Model(cfgs[r], remat_policy=plan.remat) for r in ("student", "teacher"))
  s_params = jax.eval_shape(student.init, jax.random.key(0))
  optimizer = make_optimizer(OptimConfig())
  state_sh = train_step_shardings(place, s_params, None, optimizer)[0][0]
  state = _with_shardings(jax.eval_shape(lambda p: TrainState.create(p, optimizer), s_params), state_sh)
  served = plan.teacher_serve == "vllm"  # (teacher.serve's value: the placement is the seam's to compare)
  sides = {"train": served}
  if served:
    sides["train_teacher_in_trainer"] = False  # the alternative, compiled beside it
  out, compile_s = {}, {}
  for key, served in sides.items():
    t0 = time.perf_counter()
    out[key] = _train_memory(plan, place, student, None if served else teacher, state, optimizer)
    compile_s[key] = round(time.perf_counter() - t0, 1)

  # The engine holds the student as a decode step multiplies it (per-layer, fused, in the compute
  # dtype: its install, whose output shardings XLA chooses) and a KV cache of the whole sequence.
  install = jax.jit(lambda p: install_params(p, student))
  e_params = _with_shardings(jax.eval_shape(install, state.params),
                             install.lower(state.params).compile().output_shardings)
  cache = jax.eval_shape(lambda: student.init_cache(plan.batch, plan.seq_len))
  cache = _with_shardings(cache, rules.kv_cache_shardings(cache, mesh))
  rows = rules.rows_sharding(mesh, 2)
  prompt = jax.ShapeDtypeStruct((plan.batch, plan.prompt_len), jnp.int32, sharding=rows)
  prompt_mask = jax.ShapeDtypeStruct((plan.batch, plan.prompt_len), jnp.bool_, sharding=rows)
  sampling = SamplingParams(max_new_tokens=plan.seq_len - plan.prompt_len)
  fn = jax.jit(functools.partial(generate_loop, model=student, sampling=sampling, eos_ids=(), pad_id=0),
               donate_argnames=("cache",), **place.generate_jit_kw(cache))
  t0 = time.perf_counter()
  rollout = _memory(fn.lower(e_params, cache, prompt, prompt_mask, jax.random.key(0)).compile())
  rollout_s = time.perf_counter() - t0
  rollout["student_params"] = _bytes_per_device(e_params)
  rollout["kv_cache"] = _bytes_per_device(cache)
  return {"plan": dataclasses.asdict(plan), "mesh_sizes": dict(mesh.shape), **out, "rollout": rollout,
          "compile_s": {**compile_s, "rollout": round(rollout_s, 1)}}


def _train_memory(plan: Plan, place, student, teacher, state, optimizer) -> dict:
  """The train step's per-device memory; `teacher` None: a served teacher's step (no teacher params,
  its server's answer in the batch: opdjax.training.loss.SERVED_KEYS)."""
  import jax
  import jax.numpy as jnp

  from opdjax.training.loss import LossConfig
  from opdjax.training.step import make_train_step, train_step_shardings

  t_params = None if teacher is None else jax.eval_shape(teacher.init, jax.random.key(0))
  shardings = train_step_shardings(place, state.params, t_params, optimizer)
  (_, teacher_sh, batch_sh), _ = shardings
  if t_params is not None:
    t_params = _with_shardings(t_params, teacher_sh)
  rows, length = plan.batch, plan.seq_len - 1
  kinds = {"tokens": jnp.int32, "positions": jnp.int32, "attention_mask": jnp.bool_, "targets": jnp.int32,
           "loss_mask": jnp.float32, "rollout_logprobs": jnp.float32}
  shapes = {k: ((rows, length), dt) for k, dt in kinds.items()}
  if teacher is None:
    shapes["teacher_logprobs"] = ((rows, length), jnp.float32)
    if plan.loss == "topk_rkl":
      shapes["teacher_topk_ids"] = ((rows, length, plan.topk), jnp.int32)
      shapes["teacher_topk_logprobs"] = ((rows, length, plan.topk), jnp.float32)
  batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=batch_sh) for k, (shape, dt) in shapes.items()}
  step = make_train_step(student, teacher, LossConfig(kind=plan.loss, chunk=plan.chunk, topk=plan.topk), optimizer,
                         shardings=shardings, micro_batches=plan.micro_batches)
  train = _memory(step.lower(state, t_params, batch).compile())
  train["student_params"] = _bytes_per_device(state.params)
  train["optimizer_state"] = _bytes_per_device(state.opt_state)
  train["teacher_params"] = _bytes_per_device(t_params) if t_params is not None else 0
  train["batch"] = _bytes_per_device(batch)
  return train


def run(plan: Plan, timeout_s: float = 1800) -> dict:
  """`measure(plan)` in a subprocess with `plan.devices` host devices (this process's JAX is untouched)."""
  from opdjax.errors import UserError

  env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(plan.devices), "JAX_PLATFORMS": "cpu"}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))), env.get("PYTHONPATH", "")]))
  p = subprocess.run([sys.executable, "-m", "opdjax.analyses.plan", "--worker", json.dumps(dataclasses.asdict(plan))],
                     env=env, capture_output=True, text=True, timeout=timeout_s)
  if p.returncode:
    last = [line for line in p.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
    raise UserError(f"planning {plan.teacher} -> {plan.student} on {plan.devices} devices: "
                    + last[0].removeprefix("opdjax: error: "))
  return json.loads(p.stdout.strip().splitlines()[-1])


# --- report ---

def fits(result: dict, hbm_gib: float, headroom: float) -> bool:
  peak = max(result["train"]["peak"], result["rollout"]["peak"])
  return peak <= hbm_gib * GIB * headroom


def report(result: dict, hbm_gib: float, headroom: float) -> str:
  p, m = result["plan"], result["mesh_sizes"]
  mesh = " ".join(f"{k}={v}" for k, v in m.items())
  served = "train_teacher_in_trainer" in result
  lines = [f"opdjax plan: teacher {p['teacher']} -> student {p['student']}"
           + (f" (both cut to {p['layers']} layers)" if p["layers"] else "")
           + (", teacher served by vLLM (teacher.serve=vllm)" if served else ""),
           f"  batch {p['batch']} x {p['seq_len']} tokens (prompt {p['prompt_len']})"
           + (f" in {p['micro_batches']} micro-batches of {p['batch'] // p['micro_batches']} (train.micro_batches)"
              if p.get("micro_batches", 1) > 1 else "") + f", loss {p['loss']} (chunk"
           f" {p['chunk']}), {p['dtype']} compute, remat {p['remat']}",
           f"  mesh {mesh} on {p['devices']} devices (compiled for the host CPU: GPU layouts differ; see --help)", ""]
  sides = [("train", "train step"), *([("train_teacher_in_trainer", "in trainer")] if served else []),
           ("rollout", "rollout")]
  lines.append(f"  {'per device, GiB':<22}" + "".join(f"{title:>12}" for _, title in sides))
  rows = [("student params", "student_params", "student_params"), ("optimizer state", "optimizer_state", None),
          ("teacher params", "teacher_params", None), ("batch / KV cache", "batch", "kv_cache"),
          ("arguments (total)", "arguments", "arguments"), ("outputs", "outputs", "outputs"),
          ("temporaries", "temporaries", "temporaries"), ("donated (aliased)", "aliased", "aliased"),
          ("peak", "peak", "peak")]
  for label, a, b in rows:
    cells = [f"{result[side][key] / GIB:>12.2f}" if key else f"{'-':>12}"
             for side, key in ((side, b if side == "rollout" else a) for side, _ in sides)]
    lines.append(f"  {label:<22}{''.join(cells)}")
  peak = max(result["train"]["peak"], result["rollout"]["peak"]) / GIB
  verdict = "fits" if fits(result, hbm_gib, headroom) else "does NOT fit"
  lines += [""]
  if served:
    a, b = result["train"], result["train_teacher_in_trainer"]
    lines.append(f"  teacher served: train step peak {a['peak'] / GIB:.2f} GiB per device, {b['peak'] / GIB:.2f} GiB"
                 f" with the teacher in the trainer (saves {(b['peak'] - a['peak']) / GIB:.2f} GiB; its params"
                 f" {b['teacher_params'] / GIB:.2f} GiB)")
  lines.append(f"  {verdict}: peak {peak:.2f} GiB per device vs {hbm_gib:g} GiB x {headroom:g} headroom"
               f" ({100 * peak / hbm_gib:.0f} % of HBM)")
  from opdjax.pipeline.teacher import placement_table

  lines += ["", "  which objective each teacher placement feeds (loss.kind x the teacher's placement):",
            *("    " + row for row in placement_table().splitlines())]
  return "\n".join(lines)


def _worker(argv: list[str]) -> int:
  """`python -m opdjax.analyses.plan --worker PLAN_JSON`, which `run` starts: the numbers as one JSON line."""
  from opdjax.errors import UserError

  ap = argparse.ArgumentParser(prog="python -m opdjax.analyses.plan")
  ap.add_argument("--worker", required=True, metavar="PLAN_JSON")
  spec = json.loads(ap.parse_args(argv).worker)
  try:
    print(json.dumps(measure(Plan(**{**spec, "mesh": tuple(spec["mesh"])}))))
  except UserError as e:  # one line the parent quotes
    print(f"opdjax: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(_worker(sys.argv[1:]))
