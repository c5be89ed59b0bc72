"""OPD train-step throughput and peak memory: opdjax vs PyTorch eager, in one run.

One step = student forward + teacher forward + full-vocab reverse KL
KL(p_s || p_t) as a masked token mean (prompt positions masked out) + backward on
the student + global-norm clip + AdamW. opdjax runs `make_train_step` with
`LossConfig(kind="full_rkl")`; PyTorch runs HF `Qwen3ForCausalLM` eagerly with the
teacher under `no_grad`. Both sides get the same configs and the same token batch;
they run one after the other, each in its own subprocess (see `_common.py`).

Also printed: the step's FLOPs (XLA's HLO cost analysis of the step lowered without loops, see
`step_flops`), the TFLOP/s they make and, on a GPU with a known peak, the MFU. `--remat` picks the
student's `model.remat_policy` (default full), `--attention` the models' `attention_impl`.

Precision: `--mode gpu` keeps the student's master weights in fp32 and computes in
bf16 (opdjax: `ModelConfig(dtype="bfloat16")`; PyTorch: `torch.autocast`), with the
frozen teacher's weights stored in bf16 on both sides; logits, log-softmax and KL
are fp32 on both sides. `--mode cpu` is fp32 throughout (CPUs emulate bf16).

    PYTHONPATH=. python bench/opd_step.py --mode cpu --threads 1
    PYTHONPATH=. python bench/opd_step.py --mode gpu --out runs/opd_step.md  # notes; not BENCHMARKS.md
    PYTHONPATH=. python bench/opd_step.py --mode gpu --dry-run   # shapes only, any machine
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

# Qwen3-shaped (q/k RMSNorm, tied embeddings). `steps` are timed after `warmup`.
MODES = {
    "cpu": {
        "student": dict(hidden=128, layers=2, heads=4, kv=2, head_dim=32, inter=384),
        "teacher": dict(hidden=256, layers=2, heads=4, kv=2, head_dim=64, inter=768),
        "vocab": 8192, "batch": 2, "seq": 512, "prompt": 128,
        "dtype": "float32", "warmup": 2, "steps": 5,
    },
    "gpu": {  # student: Qwen3-0.6B shape, teacher: Qwen3-1.7B shape
        "student": dict(hidden=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072),
        "teacher": dict(hidden=2048, layers=28, heads=16, kv=8, head_dim=128, inter=6144),
        "vocab": 151936, "batch": 8, "seq": 1024, "prompt": 256,
        "dtype": "bfloat16", "warmup": 2, "steps": 10,
    },
}


LR = 1e-5
BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 1.0


def cpu_peak_what(windowed: bool) -> str:
  if not windowed:
    return "peak RSS of the whole process minus RSS after imports (could not reset VmHWM)"
  return ("peak RSS during the timed steps minus RSS after imports (glibc heap trimmed at both points,"
          " so compiler leftovers and freed blocks are not counted): params, optimizer state,"
          " activations, allocator caches and compiled code")


def model_config(shape: dict, spec: dict):
  from opdjax.models import ModelConfig
  return ModelConfig(
      model_type="qwen3", vocab_size=spec["vocab"], hidden_size=shape["hidden"],
      intermediate_size=shape["inter"], num_layers=shape["layers"], num_heads=shape["heads"],
      num_kv_heads=shape["kv"], head_dim=shape["head_dim"], rope_theta=1e6, rms_norm_eps=1e-6,
      tie_word_embeddings=True, qk_norm=True, max_position_embeddings=40960, dtype=spec["dtype"])


def shapes_line(spec: dict) -> str:
  def one(s):
    return (f"hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / {s['kv']} kv heads,"
            f" head_dim {s['head_dim']}, intermediate {s['inter']}")
  return (f"student: {one(spec['student'])}; teacher: {one(spec['teacher'])}; tied embeddings,"
          f" vocab {spec['vocab']}; batch {spec['batch']} x {spec['seq']} tokens, first"
          f" {spec['prompt']} tokens are prompt (masked out of the loss); {spec['dtype']} compute;"
          f" {spec['warmup']} warm-up + {spec['steps']} timed steps")


def make_data(spec: dict):
  """Random tokens; loss_mask is 1 exactly where the target is a completion token."""
  import numpy as np
  rng = np.random.default_rng(0)
  b, seq, p = spec["batch"], spec["seq"], spec["prompt"]
  seqs = rng.integers(0, spec["vocab"], size=(b, seq + 1), dtype=np.int32)
  loss_mask = np.zeros((b, seq), np.float32)
  loss_mask[:, p - 1:] = 1.0
  positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (b, seq)).copy()
  return {"tokens": seqs[:, :-1], "targets": seqs[:, 1:], "positions": positions,
          "attention_mask": np.ones((b, seq), np.int32), "loss_mask": loss_mask}


# --- opdjax side --------------------------------------------------------------

def build_step(spec, remat_policy: str = "full", unroll_layers: bool = False, attention_impl: str = "auto",
               chunk: int | None = None):
  """`(student, teacher, optimizer, jitted step)`: the step `make_train_step` builds for the bench."""
  from opdjax.models import Model
  from opdjax.training.loss import LossConfig
  from opdjax.training.step import OptimConfig, make_optimizer, make_train_step

  scfg = model_config(spec["student"], spec).replace(attention_impl=attention_impl)
  tcfg = model_config(spec["teacher"], spec).replace(attention_impl=attention_impl)
  # No backward through the teacher: it never needs remat.
  student = Model(scfg, remat_policy=remat_policy, unroll_layers=unroll_layers)
  teacher = Model(tcfg, unroll_layers=unroll_layers)
  optimizer = make_optimizer(OptimConfig(learning_rate=LR, warmup_steps=1, b1=BETAS[0], b2=BETAS[1],
                                         max_grad_norm=MAX_GRAD_NORM))
  loss_cfg = LossConfig(kind="full_rkl") if chunk is None else LossConfig(kind="full_rkl", chunk=chunk)
  return student, teacher, optimizer, make_train_step(student, teacher, loss_cfg, optimizer)


def abstract_inputs(student, teacher, optimizer, spec):
  """`(state, teacher_params, batch)` as `ShapeDtypeStruct`s: the step's arguments, nothing allocated."""
  import jax
  import jax.numpy as jnp

  from opdjax.training.step import TrainState

  params = jax.eval_shape(student.init, jax.random.key(0))
  state = jax.eval_shape(lambda p: TrainState.create(p, optimizer), params)
  t_params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(spec["dtype"])),
                          jax.eval_shape(teacher.init, jax.random.key(1)))
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in make_data(spec).items()}
  batch["rollout_logprobs"] = batch["loss_mask"]
  return state, t_params, batch


def step_flops(spec, remat_policy: str = "full") -> float:
  """FLOPs of one train step, from XLA's HLO cost analysis of the step lowered without loops: layer
  scans unrolled, the loss in one chunk, XLA attention. The same arithmetic as the benchmarked step,
  which the compiled step's own `cost_analysis()` undercounts: it counts a loop body (a scanned
  layer, a loss chunk) once and a cuDNN attention call as no FLOPs. Remat recomputation counts."""
  import jax

  student, teacher, optimizer, step = build_step(spec, remat_policy, unroll_layers=True, attention_impl="xla",
                                                 chunk=spec["seq"])
  # Lowered for the host's CPU backend: the count is the program's, not the device's, and a PJRT
  # C-API backend (CUDA's plugin) has no pre-compile analysis (None, which once failed after timing).
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  inputs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu),
                        abstract_inputs(student, teacher, optimizer, spec))
  lowered = step.lower(*inputs)
  cost = lowered.cost_analysis()
  if cost is None:  # a host backend that is a C-API plugin too: the compiled (unrolled) program's own count
    cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if not cost or "flops" not in cost:
    raise RuntimeError(f"XLA gave no FLOP count for the step on {jax.default_backend()}: {cost!r}")
  return float(cost["flops"])


def attention_used(spec, requested: str = "auto") -> str:
  """The attention implementation the step's models pick on this backend."""
  import jax
  import jax.numpy as jnp

  from opdjax.models.attention import attention_backend
  return attention_backend(requested, jnp.dtype(spec["dtype"]), spec["student"]["head_dim"], jax.default_backend())


def jax_side(args, spec) -> dict:
  import jax
  import jax.numpy as jnp

  from opdjax.models import save_hf_params
  from opdjax.training.step import TrainState

  gpu = args.mode == "gpu"
  if gpu and jax.default_backend() != "gpu":
    raise SystemExit(f"--mode gpu needs a CUDA jax; jax.default_backend() is {jax.default_backend()!r}.")
  dev = jax.devices()[0]
  _common.trim_heap()
  base_rss = _common.rss_bytes()

  student, teacher, optimizer, step = build_step(spec, args.remat, attention_impl=args.attention)
  scfg, tcfg = student.cfg, teacher.cfg
  params = jax.jit(student.init)(jax.random.key(0))
  # The frozen teacher is cast inside the init's jit, so no fp32 teacher counts in the peak.
  cast = lambda tree: jax.tree.map(lambda x: x.astype(jnp.dtype(spec["dtype"])), tree)
  teacher_params = jax.jit(lambda k: cast(teacher.init(k)))(jax.random.key(1))
  if args.share_weights:  # fp32 on disk; the teacher's values are already rounded to its dtype
    save_hf_params(params, scfg, os.path.join(args.weights_dir, "student"))
    save_hf_params(teacher_params, tcfg, os.path.join(args.weights_dir, "teacher"))

  state = jax.jit(lambda p: TrainState.create(p, optimizer))(params)
  del params
  batch = {k: jnp.asarray(v) for k, v in make_data(spec).items()}
  batch["rollout_logprobs"] = jnp.zeros_like(batch["loss_mask"])

  t0 = time.perf_counter()
  compiled = step.lower(state, teacher_params, batch).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  xla_temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None

  losses = []
  for _ in range(spec["warmup"]):
    state, metrics = compiled(state, teacher_params, batch)
    losses.append(float(metrics["loss"]))
  windowed = _common.start_peak_window()
  def run(state):
    return jax.block_until_ready(compiled(state, teacher_params, batch))

  walls, cpus = [], []
  for _ in range(spec["steps"]):
    wall, cpu, (state, metrics) = _common.timed(functools.partial(run, state))
    walls.append(wall)
    cpus.append(cpu)

  if gpu:
    peak, peak_what = dev.memory_stats()["peak_bytes_in_use"], "device peak_bytes_in_use"
  else:
    peak, peak_what = _common.peak_rss_bytes() - base_rss, cpu_peak_what(windowed)
  return {"side": "opdjax", "step_s": statistics.median(walls), "step_times": walls,
          "cpu_step_s": statistics.median(cpus),
          "compile_s": compile_s, "peak_bytes": peak, "peak_what": peak_what,
          "xla_temp_bytes": xla_temp, "first_loss": losses[0], "device": dev.device_kind,
          "framework": f"jax {jax.__version__}", "flops_per_step": step_flops(spec, args.remat),
          "attention": attention_used(spec, args.attention), "remat_policy": args.remat}


# --- PyTorch side -------------------------------------------------------------

def torch_side(args, spec) -> dict:
  import torch
  import transformers
  from transformers import Qwen3Config, Qwen3ForCausalLM

  gpu = args.mode == "gpu"
  device = _common.torch_device(args.mode)
  torch.zeros(1, device=device)  # initialise the backend before the baseline
  _common.trim_heap()
  base_rss = _common.rss_bytes()
  compute_dtype = getattr(torch, spec["dtype"])

  def build(which, seed, dtype):
    """Created in `dtype` from the start, so no fp32 copy of the teacher counts in the peak."""
    if args.share_weights:
      return Qwen3ForCausalLM.from_pretrained(os.path.join(args.weights_dir, which), dtype=dtype).to(device)
    torch.manual_seed(seed)
    hf_cfg = Qwen3Config.from_dict(model_config(spec[which], spec).to_hf_dict())
    with device:
      return Qwen3ForCausalLM._from_config(hf_cfg, dtype=dtype)

  student = build("student", 0, torch.float32).train()
  teacher = build("teacher", 1, compute_dtype).eval().requires_grad_(False)
  opt = torch.optim.AdamW(student.parameters(), lr=LR, betas=BETAS, weight_decay=0.0, eps=1e-8)
  data = {k: torch.from_numpy(v).to(device) for k, v in make_data(spec).items()}
  tokens, positions, attn = data["tokens"].long(), data["positions"].long(), data["attention_mask"]
  mask = data["loss_mask"]

  def step():
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
      logits_s = student(input_ids=tokens, position_ids=positions, attention_mask=attn).logits
      with torch.no_grad():
        logits_t = teacher(input_ids=tokens, position_ids=positions, attention_mask=attn).logits
    logp_s = torch.log_softmax(logits_s.float(), dim=-1)
    logp_t = torch.log_softmax(logits_t.float(), dim=-1)
    kl = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    loss = (kl * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), MAX_GRAD_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  def sync():
    if gpu:
      torch.cuda.synchronize()

  t0 = time.perf_counter()
  losses = [float(step()) for _ in range(spec["warmup"])]
  warmup_s = time.perf_counter() - t0
  sync()
  windowed = _common.start_peak_window()
  walls, cpus = [], []
  for _ in range(spec["steps"]):
    wall, cpu, _ = _common.timed(lambda: (step(), sync()))
    walls.append(wall)
    cpus.append(cpu)
  if gpu:
    peak, peak_what = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
  else:
    peak, peak_what = _common.peak_rss_bytes() - base_rss, cpu_peak_what(windowed)
  return {"side": "pytorch", "step_s": statistics.median(walls), "step_times": walls,
          "cpu_step_s": statistics.median(cpus),
          "compile_s": warmup_s, "peak_bytes": peak, "peak_what": peak_what, "first_loss": losses[0],
          "device": torch.cuda.get_device_name() if gpu else "cpu",
          "framework": f"torch {torch.__version__}, transformers {transformers.__version__},"
                       f" attn {student.config._attn_implementation}"}


# --- shapes only --------------------------------------------------------------

def dry_run(args, spec) -> None:
  """Param counts and a trace of the train step at full size, without allocating it."""
  import jax

  student, teacher, optimizer, step = build_step(spec, args.remat)
  state, t_shapes, batch = abstract_inputs(student, teacher, optimizer, spec)
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  t0 = time.perf_counter()
  out_state, metrics = jax.eval_shape(step, state, t_shapes, batch)
  assert jax.tree.structure(out_state) == jax.tree.structure(state)
  trace_s = time.perf_counter() - t0

  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  with torch.device("meta"):
    hf = {w: Qwen3ForCausalLM(Qwen3Config.from_dict(m.cfg.to_hf_dict())) for w, m in
          (("student", student), ("teacher", teacher))}
  hf_count = {w: sum(p.numel() for p in m.parameters()) for w, m in hf.items()}
  print(f"mode {args.mode}: {shapes_line(spec)}")
  print(f"opdjax params: student {count(state.params) / 1e9:.3f}B, teacher {count(t_shapes) / 1e9:.3f}B;"
        f" HF: student {hf_count['student'] / 1e9:.3f}B, teacher {hf_count['teacher'] / 1e9:.3f}B")
  print(f"train step traced at full size in {trace_s:.1f}s; metrics: {sorted(metrics)}")
  flops = step_flops(spec, args.remat)
  print(f"XLA cost analysis (loop-free lowering, remat {args.remat}): {flops / 1e12:.1f} TFLOP per step,"
        f" {flops / (spec['batch'] * spec['seq']) / 1e9:.2f} GFLOP per token")
  if count(state.params) != hf_count["student"] or count(t_shapes) != hf_count["teacher"]:
    raise SystemExit("opdjax and HF parameter counts differ")


# --- parent -------------------------------------------------------------------

def report(args, spec, results: list[dict]) -> None:
  jx, pt = results
  tokens = spec["batch"] * spec["seq"]
  gib = lambda b: b / 2**30
  cpu = args.mode == "cpu"
  header = ["side", "median step (ms)", "tokens/s"] + (["tokens/s (CPU time)"] if cpu else [])
  header += ["peak mem (GiB)", "compile/warm-up (s)", "loss at step 0"]
  achieved = jx["flops_per_step"] / jx["step_s"]
  peak_flops = _common.peak_flops(jx["device"], spec["dtype"])
  mfu = achieved / peak_flops if peak_flops else None
  rows = []
  for r in results:
    row = [r["side"], f"{r['step_s'] * 1e3:.1f}", f"{tokens / r['step_s']:,.0f}"]
    row += [f"{tokens / r['cpu_step_s']:,.0f}"] if cpu else []
    row += [f"{gib(r['peak_bytes']):.3f}", f"{r['compile_s']:.1f}", f"{r['first_loss']:.6f}"]
    rows.append(row)
  speedup = pt["step_s"] / jx["step_s"]
  cpu_speedup = pt["cpu_step_s"] / jx["cpu_step_s"]
  mem_ratio = jx["peak_bytes"] / pt["peak_bytes"]
  summary = {
      "bench": "opd_step", "mode": args.mode, "threads": args.threads if cpu else None,
      "tokens_per_step": tokens,
      "opdjax_tokens_per_s": round(tokens / jx["step_s"], 1),
      "pytorch_tokens_per_s": round(tokens / pt["step_s"], 1),
      "speedup": round(speedup, 3),
      "cpu_time_speedup": round(cpu_speedup, 3) if cpu else None,
      "opdjax_peak_gib": round(gib(jx["peak_bytes"]), 3),
      "pytorch_peak_gib": round(gib(pt["peak_bytes"]), 3),
      "peak_mem_ratio": round(mem_ratio, 3),
      "loss_abs_diff_step0": abs(jx["first_loss"] - pt["first_loss"]) if args.share_weights else None,
      "flops_per_step": jx["flops_per_step"],
      "opdjax_tflops_per_s": round(achieved / 1e12, 3),
      "mfu": round(mfu, 4) if mfu is not None else None,
  }
  table = _common.markdown_table(header, rows)
  ratio_line = (f"opdjax / PyTorch eager: {speedup:.2f}x tokens/s"
                + (f" ({cpu_speedup:.2f}x in CPU time)" if cpu else "") + f", {mem_ratio:.2f}x peak memory;"
                + f" opdjax {achieved / 1e12:.2f} TFLOP/s" + (f", MFU {mfu:.1%}" if mfu is not None else ""))
  notes = [
      f"Shapes: {shapes_line(spec)}",
      f"tokens/s = batch x seq ({tokens}) / median step time (each step synced);"
      f" compile / warm-up = opdjax lower+compile, PyTorch {spec['warmup']} warm-up steps",
      *([_common.CPU_TIME_NOTE] if cpu else []),
      (f"Peak memory, both sides: {jx['peak_what']}" if jx["peak_what"] == pt["peak_what"] else
       f"Peak memory: opdjax = {jx['peak_what']}; PyTorch = {pt['peak_what']}"),
      f"opdjax: {jx['framework']}, XLA temp buffer {gib(jx['xla_temp_bytes'] or 0):.3f} GiB, attention"
      f" {jx['attention']}, student remat {jx['remat_policy']}; PyTorch: {pt['framework']}",
      f"FLOPs: {jx['flops_per_step'] / 1e12:.3f} TFLOP per step from XLA's HLO cost analysis of the step lowered"
      " without loops (layers unrolled, loss in one chunk, XLA attention; remat recomputation included);"
      + (f" MFU against {peak_flops / 1e12:.0f} TFLOP/s dense {spec['dtype']}" if peak_flops else
         " no MFU: no peak FLOP/s known for this device"),
      ("Same weights on both sides (opdjax init exported with save_hf_params), so step-0 losses"
       " should agree" if args.share_weights else "Independent random weights on each side"),
  ]
  _common.report("OPD train step", args, jx["device"], notes, table, ratio_line, summary)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--mode", choices=sorted(MODES), default="cpu")
  ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                  help="cpu mode: cores each side is pinned to (default: all available)")
  ap.add_argument("--share-weights", action=argparse.BooleanOptionalAction, default=None,
                  help="export opdjax's init to the PyTorch side so step-0 losses can be compared"
                       " (default: on for cpu, off for gpu, where it writes ~9 GB to disk)")
  ap.add_argument("--out", help="append a markdown section to this file")
  ap.add_argument("--machine", help="machine description for --out")
  ap.add_argument("--dry-run", action="store_true", help="param counts and a full-size trace only")
  ap.add_argument("--remat", choices=("nothing", "dots", "full"), default="full",
                  help="the student's remat policy (model.remat_policy)")
  ap.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                  help="attention implementation of both models (ModelConfig.attention_impl)")
  ap.add_argument("--side", choices=("jax", "torch"), help=argparse.SUPPRESS)
  ap.add_argument("--weights-dir", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.share_weights is None:
    args.share_weights = args.mode == "cpu"
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
  with tempfile.TemporaryDirectory(prefix="opd-bench-") as tmp:
    child_args = ["--mode", args.mode, "--threads", str(args.threads), "--weights-dir", tmp, "--remat", args.remat,
                  "--attention", args.attention,
                  "--share-weights" if args.share_weights else "--no-share-weights"]
    results = [_common.run_child(__file__, child_args + ["--side", side], env) for side in ("jax", "torch")]
  report(args, spec, results)


if __name__ == "__main__":
  sys.exit(main())
