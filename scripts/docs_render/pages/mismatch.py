from __future__ import annotations

from opdjax.analyses import reporting

from ..common import Figure, _g, _read_json

MISMATCH_COLUMNS = ("exact_kl", "kl_k3_tok", "abs_r_max")


def mismatch_table(r: dict) -> str:
  rows = [{"view": v, **{c: _g(m[c], 2) for c in MISMATCH_COLUMNS}} for v, m in r["result"]["views"].items()]
  return reporting.markdown_table(rows, ("view", *MISMATCH_COLUMNS))


def mismatch_attribution(r: dict) -> str:
  parts = []
  for view, rows in r["result"]["attribution"].items():
    total = rows["total"]
    each = ", ".join(f"{k} {_g(v, 3)} ({100 * v / max(total, 1e-30):.1f}%)" for k, v in rows.items() if k != "total")
    parts.append(f"`{view}` (exact KL {_g(total, 3)}): {each}")
  return "; ".join(parts)


FIGURES: dict[str, Figure] = {
    "mismatch": Figure(("opdjax mismatch --config configs/demo.py --out {out}",), _read_json("mismatch.json"),
                       {"table": mismatch_table, "attribution": mismatch_attribution}),
}
