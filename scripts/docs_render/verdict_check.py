"""`docs.py --check`'s verdict check: every verdict a result file records (scripts/reproduce.py's claims and its
contrast forms) re-derived with today's rule from the evidence stored in the file (opdjax.analyses.rederive).
A recorded label that today's rule no longer gives fails, naming the file and the claim, even when the file's
digest was recomputed after an edit: the rule, not the signature, decides. A file whose page marks it
superseded (a page module's SUPERSEDED: its name and why) renders both words instead, and is not an error."""

from __future__ import annotations

import glob
import json
import os

from .registry import FIGURES


def superseded() -> dict[str, str]:
  from .pages import reproduction

  return reproduction.SUPERSEDED


def check(root: str) -> list[str]:
  from opdjax.analyses.rederive import stale

  errors, marked = [], superseded()
  for path in sorted(glob.glob(os.path.join(root, "docs", "results", "*.json"))):
    name = os.path.basename(path)[:-5]
    result = json.load(open(path)).get("result")
    if not isinstance(result, dict) or "claims" not in result:
      continue
    diffs = stale(result)
    rel = os.path.relpath(path, root)
    if diffs and name not in marked:
      cmd = " && ".join(FIGURES[name].commands).replace("{out}", "DIR") if name in FIGURES else "its command"
      errors += [f"{rel}: claim {where} records {was!r} where today's rule on its evidence gives {now!r}: re-run"
                 f" `{cmd}` (`python scripts/docs.py --refresh {name}`) or mark it superseded"
                 " (scripts/docs_render/pages/reproduction.py, SUPERSEDED)" for where, was, now in diffs]
    elif not diffs and name in marked:
      errors.append(f"{rel}: marked superseded, but today's rule gives every recorded verdict: remove it from"
                    " SUPERSEDED (scripts/docs_render/pages/reproduction.py)")
  return errors
