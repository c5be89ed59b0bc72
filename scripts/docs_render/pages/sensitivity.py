"""docs/sensitivity.md's figures: each model's section is `opdjax sensitivity`'s own summary (the head of the
sensitivity.md it writes); the comparison of the two models is this page's own."""

from __future__ import annotations

import json
import os

from opdjax.analyses import reporting
from opdjax.analyses import sensitivity_report as report

from ..common import Figure

MODELS = ("demo", "smollm2")


def spearman(r: dict) -> str:
  """Spearman correlation of the two models' module-kind KLs over the kinds both have, per perturbation."""
  from scipy.stats import spearmanr  # imported where the view needs it (scipy: a dependency of the study's rules)

  a, b = r["result"]["demo"], r["result"]["smollm2"]
  ka, kb = ({e["kind"]: e for e in m["kinds"]} for m in (a, b))
  common = [k for k in ka if k in kb]
  points = [p for p in a["settings"]["perturbations"] if p in b["settings"]["perturbations"]]
  rhos = [spearmanr([ka[k][p] for k in common], [kb[k][p] for k in common]).statistic for p in points]
  table = reporting.markdown_table([[f"Spearman over {len(common)} common kinds", *(f"{x:.2f}" for x in rhos)]],
                                   ["perturbation", *map(report._label, points)])
  negative = sum(x < 0 for x in rhos)
  return table + f"\n\n{negative} of the {len(rhos)} coefficients are negative, the largest {max(rhos):.2f}."


FIGURES: dict[str, Figure] = {
    "sensitivity": Figure(("opdjax sensitivity --out {out}/demo",
                           "opdjax sensitivity --config configs/smollm2_sensitivity.py --out {out}/smollm2"),
                          lambda out: {m: json.load(open(os.path.join(out, m, "sensitivity.json"))) for m in MODELS},
                          {**{m: (lambda r, m=m: report.summary(r["result"][m])) for m in MODELS},
                           "spearman": spearman},
                          images=tuple((f"docs/figures/sensitivity_{m}{tail}.png",
                                        lambda result, path, m=m, plot=plot: plot(result[m], path))
                                       for m in MODELS
                                       for tail, plot in (("", report.plot_sweep), ("_recipe", report.plot_recipe)))),
}
