"""docs/reproduction.md's verdicts and the evidence behind them: scripts/reproduce_report.py's renderers (the ones
reproduce.py's own reproduction.md uses)."""

from __future__ import annotations

from ..common import Figure, _read_json, script

# Result files whose recorded verdicts today's rules no longer all give (opdjax.analyses.rederive): their pages
# show both words (`reproduce_report.label`); docs.py --check fails on any other such file (verdict_check.py).
SUPERSEDED: dict[str, str] = {}


def _figure(task: str, *views: str) -> Figure:
  return Figure((f"python scripts/reproduce.py --task {task} --out {{out}}",), _read_json("reproduction.json"),
                {v: script("reproduce_report", v) for v in views})


FIGURES: dict[str, Figure] = {
    "reproduction_smollm2": _figure("smollm2", "table", "evidence", "findings", "summary"),
    "reproduction_addition": _figure("addition", "table", "evidence", "findings", "objectives"),
}
