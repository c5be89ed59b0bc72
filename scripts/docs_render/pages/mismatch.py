"""docs/mismatch.md's table: `opdjax mismatch`'s own printout (opdjax.analyses.mismatch.format_tables)."""

from __future__ import annotations

from ..common import Figure, _read_json


def report(r: dict) -> str:
  from opdjax.analyses import mismatch  # imported where the view needs it: it imports jax

  return f"```\n{mismatch.format_tables(r['result'])}\n```"


FIGURES: dict[str, Figure] = {
    "mismatch": Figure(("opdjax mismatch --config configs/demo.py --out {out}",), _read_json("mismatch.json"),
                       {"report": report}),
}
