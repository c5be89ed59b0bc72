"""What each `opdjax` command does: its arguments (`*_arguments(parser)`) and its `run(args, overrides)`.

`opdjax.cli.COMMANDS` lists them; analyses live in opdjax/analyses/, this module only turns flags
into their calls.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex

from opdjax.config.resolve import resolve_config
from opdjax.errors import UserError


def out_options(p: argparse.ArgumentParser, required: bool, help_: str) -> None:
  # Required to run, not to --print-config (checked in resolved_config).
  p.add_argument("--out", help=help_ + (" (required)" if required else ""))
  p.set_defaults(out_required_=required)
  p.add_argument("--overwrite", action="store_true",
                 help="write into a non-empty --out that holds no run of this command (its own files are replaced,"
                      " nothing else is touched)")


def resolved_config(args, overrides: dict[str, str]):
  """The command's typed config, or None once --print-config has printed it."""
  from opdjax.config.resolve import config_listing

  if not args.print_config:
    if getattr(args, "out_required_", False) and not args.out:
      args.parser_.error("the following arguments are required: --out")
    return resolve_config(getattr(args, "config", None), overrides)
  print(config_listing(getattr(args, "config", None), overrides))
  from opdjax.config.loader import ConfigError
  from opdjax.rollout.deploy import describe_config

  try:
    cfg = resolve_config(getattr(args, "config", None), overrides)
  except ConfigError:  # not runnable as it is: the listing's last line says why
    return None
  if describe_config(cfg.rollout):  # the layout the keys make: which devices the trainer's mesh gets
    print(f"# {describe_config(cfg.rollout)}")
  return None


def check_out(args) -> None:
  from opdjax.pipeline.outdir import check_out_dir

  if args.out:
    check_out_dir(args.out, args.command_.name, args.overwrite)


# --- train / demo ---

def train_arguments(p: argparse.ArgumentParser) -> None:
  out_options(p, True, "output folder (metrics.jsonl, config.json, student/, checkpoints/)")
  p.add_argument("--resume", action="store_true",
                 help="require a checkpoint in --out to resume from (an --out with one resumes anyway)")
  p.add_argument("--resume-fallback", action="store_true",
                 help="if the latest checkpoint cannot be restored, resume from the previous good one")
  multi = p.add_argument_group("multi-process runs (jax.distributed; none of these: SLURM / Open MPI detection"
                               " when they launched several tasks, else one process)")
  multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address; every process gives the same")
  multi.add_argument("--num-processes", type=int, metavar="N", help="how many processes the run has")
  multi.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 <= I < N")
  multi.add_argument("--coordinator-timeout", type=float, default=120.0, metavar="S",
                     help="seconds to wait for every process to join before one clear error (default 120)")
  from opdjax.pipeline.teacher import placement_table

  p.epilog = (f"{p.epilog or ''}\n\nWhich objective (loss.kind) each teacher placement feeds (teacher.serve,"
              f" rollout.teacher_scoring):\n{placement_table()}").lstrip()


def train(args, overrides) -> int:
  from opdjax.pipeline import distributed

  # Before anything starts a JAX backend.
  distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.coordinator_timeout)
  cfg = resolved_config(args, overrides)
  if cfg is None:
    return 0
  from opdjax.api import train as api_train

  try:
    result = api_train(cfg, args.out, resume="require" if args.resume else "auto", fallback=args.resume_fallback,
                       overwrite=args.overwrite, command=shlex.join(["opdjax", *getattr(args, "argv_", ["train"])])
                       ).result  # the Python API's function: one path for both
  except Exception:
    distributed.grace_for_lost_peer()  # a dead peer, not the collective it broke, is the one line the user sees
    raise
  distributed.finish()
  print(result.summary())
  if result.final_step == result.start_step:
    print(f"{args.out}/metrics.jsonl and {args.out}/student/ untouched")
  else:
    print(f"wrote {args.out}/metrics.jsonl and {args.out}/student/")
  return 0


# --- analyses on a config: mismatch, sensitivity, prefix-shift, calibrate; admit on a budget ---

def analysis(module: str, fn: str = "run", report: str = "report"):
  def run(args, overrides) -> int:
    cfg = resolved_config(args, overrides)
    if cfg is None:
      return 0
    check_out(args)
    m = importlib.import_module(module)
    print(getattr(m, report)(getattr(m, fn)(cfg, args.out)))
    return 0
  return run


def analysis_arguments(out_help: str = "output folder (JSON/CSV/markdown + PNG plots)", required: bool = True):
  """An analysis's own options beyond the config: its --out."""
  return lambda p: out_options(p, required, out_help)


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
  out_options(p, True, "output folder (budget.json, calibration.csv/md, curves.json, budget.png)")
  p.add_argument("--bracket", action="store_true",
                 help="after the views, spend seeds where a quality-loss interval straddles the tolerance and extend"
                      " the noise ladder (x calibrate.bracket_factor) until a view fails clearly or the next rung"
                      " passes calibrate.bracket_ceiling (= --config.calibrate.bracket=true)")


def calibrate(args, overrides) -> int:
  if args.bracket:
    overrides = {**overrides, "calibrate.bracket": "true"}
  return analysis("opdjax.analyses.admission", fn="calibrate")(args, overrides)


def admit_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--budget", help="budget.json written by `opdjax calibrate` (--teacher: default train.budget)")
  p.add_argument("--candidates",
                 help="a file with one candidate per line: NAME: ENGINE-VIEW (e.g. 'fp8: weights=fp8,lag=1')")
  p.add_argument("--teacher", action="store_true",
                 help="admit the served teacher of the run --config describes instead (its replicas against each"
                      " other, its precision against the trainer's, the figure against the budget; exit code 3"
                      " when refused); any --config.* override applies")
  p.add_argument("--config", metavar="FILE", help="--teacher: the run's configs/*.py")
  out_options(p, False, "folder for admission.json/csv/md and admission.png (--teacher: teacher_admission.json)")


def admit(args, overrides) -> int:
  from opdjax.analyses import admission

  if args.teacher:
    from opdjax.analyses import reporting
    from opdjax.pipeline import teacher_preflight

    if args.candidates:
      raise UserError("--teacher admits the run's served teacher; --candidates screens rollout engines: give one.")
    if not args.config:
      raise UserError("opdjax admit --teacher needs the run's --config FILE (with its --config.* overrides).")
    cfg = resolve_config(args.config, overrides)
    check_out(args)
    result = teacher_preflight.preflight(cfg, args.out, args.budget)
    if args.out:
      reporting.write_json(os.path.join(args.out, "teacher_admission.json"), result)
    print(teacher_preflight.report(result))
    return 0 if result["admitted"] else 3
  if not args.budget or not args.candidates:
    raise UserError("opdjax admit needs --budget and --candidates (or --teacher with the run's --config).")
  check_out(args)
  print(admission.report(admission.admit(args.budget, args.candidates, args.out, overrides)))
  return 0


# --- no config: kv-capacity, plan, export, models ---

def kv_capacity_arguments(p: argparse.ArgumentParser) -> None:
  from opdjax.analyses.capacity import DEFAULT_BLOCK_SIZE, DEFAULT_RESERVE_FRACTION, KNOWN_SHAPES

  p.add_argument("--model", required=True,
                 help=f"HF folder, config.json, fetch:smollm2-135m, or a known shape: {', '.join(KNOWN_SHAPES)}")
  p.add_argument("--memory-gib", type=float, required=True, help="device memory the engine may use (e.g. 80*0.9=72)")
  p.add_argument("--reserve-gib", type=float,
                 help=f"activation/runtime reserve (default {DEFAULT_RESERVE_FRACTION * 100:g}%% of --memory-gib)")
  p.add_argument("--recipe", default="fp8",
                 help="weights: bf16, a preset (fp8, fp8_block, fp8_e5m2, int8), 'pattern>format|...',"
                      " or a recipe file (spec or sensitivity JSON)")
  p.add_argument("--keep-edge-layers", type=int, default=0, help="preset recipes: first/last N layers' weights bf16")
  p.add_argument("--kv-bf16-layers", default="", help="layers whose KV stays bf16 with fp8 KV, e.g. 0,27 (default for"
                 " a recipe file or view: its own, as rollout.vllm.recipe serves it)")
  p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens a KV block (vLLM GPU: 16)")
  p.add_argument("--json", help="write the result as JSON to this file")
  p.add_argument("--out", help="folder to write kv_capacity.json into")


def kv_capacity(args, overrides) -> int:
  from opdjax.analyses import capacity, reporting
  from opdjax.rollout.vllm import recipe as served

  name, cfg = capacity.load_model_config(args.model)
  recipe = capacity.load_recipe(args.recipe, cfg.num_layers, args.keep_edge_layers)
  label = os.path.basename(args.recipe) if os.path.isfile(args.recipe) else args.recipe
  kv_layers = capacity.parse_layers(args.kv_bf16_layers)
  if not args.kv_bf16_layers and (os.path.isfile(args.recipe) or ">" in args.recipe):  # as a vLLM server keeps them
    kv_layers = list(served.kv_bf16_layers(served.load(args.recipe, "--recipe"), cfg, "--recipe"))
  result = {"model": name, "num_layers": cfg.num_layers,
            **capacity.capacity_table(cfg, recipe, args.memory_gib, args.reserve_gib, kv_layers, args.block_size,
                                      recipe_name=label if ">" not in label else "recipe")}
  print(capacity.report(result))
  paths = ([args.json] if args.json else []) + ([os.path.join(args.out, "kv_capacity.json")] if args.out else [])
  for path in paths:
    try:
      reporting.write_json(path, result)
    except OSError as e:
      raise UserError(f"could not write {path} ({e}); pass a writable --json/--out path.") from None
  return 0


def plan_arguments(p: argparse.ArgumentParser) -> None:
  from opdjax.analyses import plan as planning
  from opdjax.analyses.capacity import KNOWN_SHAPES

  method = planning.__doc__.split("\n\n", 2)[2]  # what the numbers are (the XLA CPU compile's) and the headroom
  from opdjax.pipeline.teacher import placement_table
  from opdjax.training.loss import OBJECTIVES

  p.epilog = (f"Models: {', '.join(KNOWN_SHAPES)}, or an HF folder / config.json.\n\n{method}\n\nWhich objective each"
              f" teacher placement feeds (--loss x --teacher-serve):\n{placement_table()}")
  p.add_argument("--teacher", help="teacher model (required, but for --schedule --measure)")
  p.add_argument("--student", help="student model (required, but for --schedule --measure)")
  p.add_argument("--devices", type=int, default=8, help="devices of the mesh (default 8)")
  p.add_argument("--mesh", default="fsdp=-1", help="axis sizes, e.g. 'fsdp=8', 'data=2,fsdp=4' (default fsdp=-1)")
  p.add_argument("--batch", type=int, default=64, help="sequences per step (default 64)")
  p.add_argument("--micro-batches", type=int, default=1, help="train.micro_batches: the step's gradient accumulated"
                 " over N micro-batches of --batch / N sequences, one update (default 1)")
  p.add_argument("--seq-len", type=int, default=1024, help="prompt + completion tokens (default 1024)")
  p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of the rollout (default 512)")
  p.add_argument("--loss", choices=list(OBJECTIVES), default="full_rkl", help="loss.kind (default full_rkl)")
  p.add_argument("--chunk", type=int, default=128, help="loss.chunk: positions per logits chunk (default 128)")
  p.add_argument("--topk", type=int, default=16, help="loss.topk: the top-K of topk_rkl (default 16)")
  p.add_argument("--teacher-serve", choices=("trainer", "vllm"), default="trainer",
                 help="teacher.serve (default trainer); vllm: the trainer holds no teacher params (loss sampled_rkl"
                      " or topk_rkl), planned beside the step with the teacher in the trainer")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
  p.add_argument("--remat", choices=("nothing", "dots", "full"), default="full",
                 help="rematerialisation (default full)")
  p.add_argument("--layers", type=int, default=0, help="cut both models to N layers (faster compiles; see"
                 " docs/scaling.md for scaling the result back)")
  p.add_argument("--hbm-gib", type=float, default=141.0, help="device memory: 141 H200 (default), 80 H100")
  p.add_argument("--headroom", type=float, default=0.9, help="fraction of HBM the peak may use (default 0.9)")
  p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
  schedule_arguments(p)


def schedule_arguments(p: argparse.ArgumentParser) -> None:
  from opdjax.analyses.schedule_model import DEVICES, EFFICIENCY

  s = p.add_argument_group("--schedule: the predicted steady-state step time of sync colocated, sync disaggregated"
                           " and async k, and the rollout/trainer device split minimising it (modelled from"
                           " --teacher/--student on --devices x --device, or measured with --measure)")
  s.add_argument("--schedule", action="store_true", help="predict the step schedule instead of the memory plan")
  s.add_argument("--measure", nargs="+", metavar="RUN", help="per-stage costs from these runs' time split (run folders"
                 " or metrics.jsonl of timed or asynchronous runs; a configs/*.py is run here, sync and async)"
                 " instead of the model; each run's costs also predict the step of a run of the other kind")
  s.add_argument("--steps", type=int, default=30, help="steps a config given to --measure runs each way (default 30)")
  s.add_argument("--device", choices=sorted(DEVICES), default="h100-sxm", help="device table entry (default h100-sxm)")
  s.add_argument("--rollout-devices", type=int, default=0, help="the rollout engine's devices (default 0: every split)")
  s.add_argument("--depth", type=int, default=1, help="async k, rollout.async_depth (default 1)")
  s.add_argument("--fp8", action="store_true", help="the engine's weights and KV cache in FP8 (FP8 GPUs)")
  s.add_argument("--fp8-generate-speedup", type=float, default=1.0, metavar="X",
                 help="--measure: generation X times faster with FP8, an input (CPU cannot measure it; needs"
                      " --fp8-source)")
  s.add_argument("--fp8-source", default="", metavar="TEXT",
                 help="where --fp8-generate-speedup comes from (a benchmark, a paper), printed with it")
  s.add_argument("--efficiency", default="", metavar="NAME=F,...",
                 help=f"fractions of the peaks reached (default {','.join(f'{k}={v}' for k, v in EFFICIENCY.items())})")


def plan_schedule(args) -> int:
  from opdjax.analyses import schedule, schedule_model

  if args.depth < 1:
    raise UserError(f"--depth {args.depth}: async k is >= 1 (the synchronous baselines are predicted with it).")
  if args.measure:
    result = schedule.predict_measured(args.measure, args.depth, args.fp8_generate_speedup, args.steps,
                                         args.fp8_source)
  else:
    if not (args.teacher and args.student):
      raise UserError("--schedule models the costs from --teacher and --student (or give --measure RUN ...).")
    result = schedule_model.modelled(args.teacher, args.student, devices=args.devices, device=args.device,
                               batch=args.batch, seq_len=args.seq_len, prompt_len=args.prompt_len, fp8=args.fp8,
                               remat=args.remat, efficiency=args.efficiency, rollout_devices=args.rollout_devices,
                               k=args.depth)
  print(schedule.report(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return 0


def plan(args, overrides) -> int:
  from opdjax.analyses import plan as planning

  if args.prompt_len >= args.seq_len:
    raise UserError(f"--prompt-len {args.prompt_len} must be below --seq-len {args.seq_len} (room to generate).")
  if args.schedule:
    return plan_schedule(args)
  if not (args.teacher and args.student):
    raise UserError("opdjax plan needs --teacher and --student (the models whose memory it plans).")
  spec = planning.Plan(args.teacher, args.student, args.devices, planning.parse_mesh(args.mesh), args.batch,
                       args.seq_len, args.prompt_len, args.loss, args.chunk, args.dtype, args.remat, args.layers,
                       args.teacher_serve, args.topk, args.micro_batches)
  result = planning.run(spec)
  print(planning.report(result, args.hbm_gib, args.headroom))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({**result, "hbm_gib": args.hbm_gib, "fits": planning.fits(result, args.hbm_gib, args.headroom)}, f,
                indent=2)
  return 0


def export_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--checkpoint", required=True, help="the run's --out folder (or its checkpoints/)")
  p.add_argument("--out", required=True, help="new HF folder to write")
  p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")


def export(args, overrides) -> int:
  from opdjax.pipeline.export import export as export_run

  step = export_run(args.checkpoint, args.out, args.step)
  print(f"wrote the student of step {step} of {args.checkpoint} to {args.out}")
  return 0


def fetch_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("name", help="smollm2-135m")
  p.add_argument("--cache-dir", help="cache root (default: $OPDJAX_CACHE or ~/.cache/opdjax)")


def fetch(args, overrides) -> int:
  from opdjax.models.fetch import fetch as fetch_model

  print(fetch_model(args.name, args.cache_dir))
  return 0


# --- launch: helpers of launch/*.sh ---

def sidecar_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", required=True, help="HF folder the sidecar starts from")
  p.add_argument("--port", type=int, required=True, help="port the sidecar listens on")
  p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
  p.add_argument("--out", default=".", help="the run's folder (vLLM's caches go under it; default .)")


def sidecar(args, overrides) -> int:
  """The files the config names (task.path, ...) are the cluster's: not checked here."""
  import shlex

  from opdjax.config.resolve import paths_unchecked
  from opdjax.rollout.vllm.launch import sidecar_command

  with paths_unchecked():
    cfg = resolved_config(args, overrides)
  if cfg is not None:
    print(shlex.join(sidecar_command(cfg, args.model, args.port, args.tp, args.out)))
  return 0
