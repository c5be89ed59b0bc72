"""Does the admission verdict predict training quality? Calibrate, admit candidates, then train each.

  python scripts/validate_admission.py --out runs/validate [--budget runs/cal/budget.json]

Without --budget, calibrates first (the demo config's `calibrate` section) into OUT/calibration.
Then `admit` screens the candidates (default: eight spanning FP8 weights, FP8 KV cache, INT8,
staleness and noise) and each candidate is trained exactly like a calibration point (same start,
steps, seeds); its quality loss against the calibration's clean runs is judged with the budget's
own tolerance. Writes OUT/validation.{json,md} and OUT/validation.png; docs/admission.md records
the result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from opdjax.analyses import admission, reporting
from opdjax.analyses.sweep import final_quality, sweep_config, train_run
from opdjax.config.resolve import resolve_config, split_overrides
from opdjax.config.schema import build
from opdjax.pipeline.guards import load_budget
from opdjax.pipeline.session import Session
from opdjax.views.view import EngineView

CANDIDATES = """\
fp8: weights=fp8
fp8-kv8: weights=fp8,kv_quant=fp8_e4m3
int8-lag1: weights=int8,lag=1
lag16: lag=16
e5m2-noise0.5: weights=fp8_e5m2,noise_sigma=0.5
noise1.2: noise_sigma=1.2
fp8-noise2: weights=fp8,noise_sigma=2.0
noise2.4: noise_sigma=2.4
"""


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--budget", help="an existing budget.json (default: calibrate first)")
  ap.add_argument("--config", help="configs/*.py for the calibration (default: the demo's)")
  ap.add_argument("--candidates", help="candidates file (default: the built-in list)")
  args, extra = ap.parse_known_args(argv)
  os.makedirs(args.out, exist_ok=True)
  budget_path = args.budget
  if budget_path and (args.config or extra):
    ap.error("--config and --config.* overrides configure the calibration; with --budget the budget's config is used")
  if not budget_path:
    budget_path = os.path.join(args.out, "calibration", "budget.json")
    if os.path.exists(budget_path):  # a re-run reuses the finished calibration
      print(f"using the calibration in {budget_path}")
    else:
      admission.calibrate(resolve_config(args.config, split_overrides(extra)), os.path.dirname(budget_path))
  budget = load_budget(budget_path)
  cands_path = args.candidates or os.path.join(args.out, "candidates.txt")
  if not args.candidates:
    reporting.write_text(cands_path, CANDIDATES)
  adm = admission.admit(budget_path, cands_path, os.path.join(args.out, "admission"))
  print(admission.report(adm))

  cfg = build(budget["config"])
  c = cfg.calibrate
  runner = Session(sweep_config(cfg, c.steps, c.eval_every))
  fit = budget["fit"]
  clean = next(p for p in budget["points"] if p["view"] == "clean")
  rows = []
  for cand in adm["candidates"]:
    view = EngineView.parse(cand["view"])
    t0 = time.time()
    finals = [final_quality(train_run(runner, view, seed=cfg.seed + s, desc=f"{cand['name']} seed {s}"))
              for s in range(fit["seeds"])]  # as many seeds as the calibration's views had
    train_s = time.time() - t0
    row = {"name": cand["name"], "view": cand["view"], "mismatch": cand["mismatch"], "ci_high": cand["ci_high"],
           "verdict": cand["verdict"]}
    quality = {m: [f[m] for f in finals] for m in fit["metrics"]}
    loss, ok = admission.judge(quality, clean, fit)  # the budget fit's own rule
    for m in fit["metrics"]:
      row[f"{m}_median"] = float(np.median(quality[m]))
      row[m] = [round(v, 4) for v in quality[m]]
      row[f"loss_{m}"] = loss[m]
    row["quality_ok"] = ok
    row["agrees"] = (cand["verdict"] == "accept") == ok
    row["admit_s"] = cand["seconds"]
    row["train_s"] = round(train_s, 1)
    rows.append(row)
    print(reporting.markdown_table([row]), flush=True)
  result = {"budget": budget["budget"], "tolerance": fit["tolerance"], "clean": {m: float(np.median(clean[m]))
            for m in fit["metrics"]}, "rows": rows, "agree": sum(r["agrees"] for r in rows), "total": len(rows)}
  reporting.write_json(os.path.join(args.out, "validation.json"), result)
  reporting.write_text(os.path.join(args.out, "validation.md"), reporting.markdown_table(rows) + "\n")
  plot(budget, rows, os.path.join(args.out, "validation.png"))
  print(markdown({"budget": budget, "validation": result}))
  return 0


def markdown(res: dict) -> str:
  """docs/admission.md's validation (and this script's last printout), from {"budget": budget.json, "validation":
  validation.json}: the time it took, one row a candidate, then the study's rule for claim 5 on these candidates
  (agreement against accept-all and reject-all)."""
  from opdjax.analyses import verdicts  # scipy: imported where it is needed

  rows, metrics = res["validation"]["rows"], res["budget"]["fit"]["metrics"]  # (a task without a verifier: no accuracy)
  admit, train = [v["admit_s"] for v in rows], [v["train_s"] for v in rows]
  seeds = lambda v, m: f" ({', '.join(f'{x:.3g}' for x in v[m])})" if m == "reverse_kl" else ""  # noqa: E731
  table = [[v["name"], v["verdict"], *(f"{v[f'{m}_median']:.3g}{seeds(v, m)}" for m in metrics),
            "yes" if v["quality_ok"] else "no",
            "yes" if v["agrees"] else "**no** (" + ("too strict" if v["verdict"] == "reject" else "false accept") + ")"]
           for v in rows]
  heads = ["reverse KL median (seeds)" if m == "reverse_kl" else f"{m.replace('_', ' ')} median" for m in metrics]
  rule = verdicts.admission_vs_trivial(rows, budget_trusted=not res["budget"].get("warning"))
  ev = rule.evidence
  return (f"{sum(train) / 60:.1f} minutes of training; admission took {min(admit):.2g}-{max(admit):.2g} s per candidate"
          f" against {min(train):.0f}-{max(train):.0f} s of training per candidate.\n\n"
          + reporting.markdown_table(table, ["candidate", "verdict", *heads, "quality within tolerance",
                                             "verdict right"])
          + f"\n\n{ev['agree']} of {ev['total']} verdicts agree with the trained quality; accepting every candidate"
          f" would agree on {ev['accept_all']}, rejecting every one on {ev['reject_all']}; false accepts:"
          f" {', '.join(ev['false_accepts']) or 'none'}. The rule of claim 5: **{rule.outcome}** ({rule.reason}).")


def plot(budget, rows, path):
  metrics = budget["fit"]["metrics"]
  fig, axes = reporting.figure(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
  clean = next(p for p in budget["points"] if p["view"] == "clean")
  xs = [p["mismatch"] for p in budget["points"] + rows if p["mismatch"] > 0]
  floor = min(xs) / 10 if xs else 1e-9
  for ax, m in zip(axes[0], metrics):
    for p in budget["points"]:
      ax.scatter(max(p["mismatch"], floor), np.median(p[m]), marker="o", color="gray", s=18)
    for r in rows:
      color = "tab:blue" if r["verdict"] == "accept" else "tab:orange"
      ax.scatter(max(r["mismatch"], floor), r[f"{m}_median"], marker="*" if r["agrees"] else "x", color=color, s=70)
      ax.annotate(r["name"], (max(r["mismatch"], floor), r[f"{m}_median"]), fontsize=6, xytext=(3, 3),
                  textcoords="offset points")
    ax.axhline(np.median(clean[m]) + admission.QUALITY[m] * budget["fit"]["tolerance"][m], color="gray", ls=":")
    ax.axvline(max(budget["budget"], floor), color="black", ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("mismatch (exact KL per token)")
    ax.set_ylabel(f"final held-out {m} (median of seeds)")
    if m == "reverse_kl":
      ax.set_yscale("log")
    ax.set_title("grey: calibration; blue accept / orange reject; x = verdict wrong", fontsize=8)
  reporting.save_figure(fig, path)


if __name__ == "__main__":
  sys.exit(main())
