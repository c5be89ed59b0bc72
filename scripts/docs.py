"""Figures in README.md, BENCHMARKS.md and docs/*.md, rendered from the result files their commands wrote.

A figure is a whole table or paragraph between marker comments, `<!-- docs.py:NAME.VIEW -->` and
`<!-- /docs.py:NAME.VIEW -->`: NAME a result file (docs/results/NAME.json: the command, commit, machine, date and
what it measured, signed with a `digest`), VIEW one of its renderers, most of them the command's own (its report:
scripts/docs_render/pages/, a module a page); `NAME.provenance` works for every NAME.

  python scripts/docs.py --check                    # every block equals its rendering, every PNG its drawing, every
                                                    # digest its file, no number outside markers (CI)
  python scripts/docs.py --check --demo-run DIR     # ... and the README's demo line equals that run's
  python scripts/docs.py --render                   # rewrite every block and PNG from the result files
  python scripts/docs.py --refresh NAME [--from DIR]  # rerun NAME's command (or read DIR, a folder `--record`
                                                       # signed), rewrite its result file, its PNGs and the docs
  python scripts/docs.py --record NAME --into DIR   # run NAME's command into DIR with its signed record
                                                    # (on the machine that measures, e.g. the lent GPU)
  python scripts/docs.py --list                     # the registry

Past measurements live in docs/history.md, unrendered. How to add a figure: docs/CONTRIBUTING.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
from docs_render import core  # noqa: E402
from docs_render.common import ROOT, DocsError  # noqa: E402
from docs_render.registry import FIGURES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  act = ap.add_mutually_exclusive_group(required=True)
  act.add_argument("--check", action="store_true", help="fail naming file, line and both values on a difference")
  act.add_argument("--refresh", metavar="NAME", help="rerun NAME's command, rewrite its result file and the docs")
  act.add_argument("--render", action="store_true", help="rewrite every block from the result files")
  act.add_argument("--list", action="store_true", help="print every NAME, its command and its result file")
  act.add_argument("--record", metavar="NAME", help="run NAME's command into --into DIR and sign what it wrote")
  ap.add_argument("--into", metavar="DIR", help="with --record: the new folder the command writes")
  ap.add_argument("--demo-run", metavar="RUN", help="with --check: a demo run folder (or its metrics.jsonl)"
                  " whose numbers the README's demo line must equal")
  ap.add_argument("--from", dest="from_dir", metavar="DIR", help="with --refresh: read DIR, a folder `--record"
                  " NAME --into DIR` wrote (elsewhere), instead of running the command")
  ap.add_argument("--root", default=ROOT, help="the repository to work on (default: this one)")
  args = ap.parse_args(argv)
  try:
    if args.list:
      for name, fig in FIGURES.items():
        print(f"{name}: {' && '.join(fig.commands)} -> docs/results/{name}.json (views: {', '.join(fig.views)})")
      return 0
    if args.record:
      if args.record not in FIGURES or not args.into:
        raise DocsError(f"--record needs a known NAME and --into DIR (known: {', '.join(FIGURES)})")
      rec = core.record(args.root, args.record, os.path.abspath(args.into))
      print(f"docs.py: ran {args.record} into {args.into}, signed ({core.RECORD}, machine: {rec['machine']});"
            f" bring the folder back and run `python scripts/docs.py --refresh {args.record} --from DIR`")
      return 0
    if args.refresh:
      if args.refresh not in FIGURES:
        raise DocsError(f"unknown NAME {args.refresh!r}; known: {', '.join(FIGURES)}")
      core.refresh(args.root, args.refresh, args.from_dir)
    if args.refresh or args.render:
      print(f"docs.py: rewrote {', '.join(core.render_all(args.root)) or 'nothing (all up to date)'}")
      return 0
    errors = core.check(args.root, args.demo_run)
  except DocsError as e:
    print(f"docs.py: {e}", file=sys.stderr)
    return 2
  for e in errors:
    print(e, file=sys.stderr)
  if errors:
    print(f"docs.py: {len(errors)} problem(s): a figure or PNG that differs from its result file (`python"
          " scripts/docs.py --render` rewrites it from the file, `--refresh NAME` re-measures) or a number outside"
          " the markers", file=sys.stderr)
    return 1
  print("docs.py: every rendered figure and PNG equals its result file; no number outside markers and code")
  return 0


if __name__ == "__main__":
  sys.exit(main())
