from __future__ import annotations

from opdjax.analyses import prefix_shift_report

from ..common import Figure, _read_json


def prefix_shift_head(r: dict) -> str:
  return prefix_shift_report.report(r["result"]).split("\n")[0]


def prefix_shift_table(r: dict) -> str:
  return prefix_shift_report.summary_table(r["result"])


PSR = prefix_shift_report


FIGURES: dict[str, Figure] = {
    "prefix_shift": Figure(("opdjax prefix-shift --out {out}",), _read_json("prefix_shift.json"),
                           {"head": prefix_shift_head, "table": prefix_shift_table},
                           images=(("docs/figures/prefix_shift_divergence.png", PSR.plot_divergence),
                                   ("docs/figures/prefix_shift_signal_error.png", PSR.plot_signal_error))),
}
