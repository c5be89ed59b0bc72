"""docs/admission.md's figures: what `opdjax calibrate` and `opdjax admit` print (opdjax.analyses.admission.report),
scripts/validate_admission.py's and scripts/compare_opd_grpo.py's own renderers."""

from __future__ import annotations

import json
import os

from ..common import Figure, module, script

ADMISSION = "opdjax.analyses.admission"  # imported where a view needs it: it imports jax


def collect_admission(out: str) -> dict:
  """scripts/validate_admission.py's three files: the calibration's budget (its points with every seed), the
  admission of the candidates and their trained quality; the budget's config stays in the run folder."""
  budget = json.load(open(os.path.join(out, "calibration", "budget.json")))
  return {"budget": {k: v for k, v in budget.items() if k != "config"},
          "admission": json.load(open(os.path.join(out, "admission", "admission.json"))),
          "validation": json.load(open(os.path.join(out, "validation.json")))}


def calibration(r: dict) -> str:
  """`opdjax calibrate`'s printout (its caveats derived again from the points), after what it took."""
  admission, b = module(ADMISSION), r["result"]["budget"]
  fit, warn = b["fit"], f" **{b['warning']}**" if b.get("warning") else ""
  return (f"{b['provenance']['wall_s'] / 60:.1f} minutes for {len(b['points'])} views x {fit['seeds']} seeds; the"
          f" clean seeds' std {fit['clean_std']['reverse_kl']:.3g} (reverse KL) and {fit['clean_std']['accuracy']:.3g}"
          f" (accuracy).{warn}\n\n"
          + admission.report({**b, "caveats": admission.caveats(b["points"], fit, b["start"])}))


OPD_GRPO = "python scripts/compare_opd_grpo.py --steps 800 --eval-every 50 --out {out}/"


def _compare_run(path: str) -> dict:
  """One compare.json without its per-step records: each run keeps its evaluations (step, held-out accuracy
  and reverse KL at the steps that evaluated: the PNG's curves)."""
  c = json.load(open(path))
  runs = {k: [{f: r[f] for f in ("step", "accuracy", "reverse_kl")} for r in recs if r.get("eval_step", 0) == r["step"]]
          for k, recs in c["runs"].items()}
  return {**{k: v for k, v in c.items() if k != "runs"}, "runs": runs}


def collect_opd_grpo(out: str) -> dict:
  """The comparison (OPD and GRPO, five views) and GRPO with TIS on three of them; the commit and the load
  are the runs' own (`--refresh opd_grpo --from DIR` keeps them)."""
  main, tis = (_compare_run(os.path.join(out, part, "compare.json")) for part in ("main", "tis"))
  return {"commit": main["commit"], "load_average": {"start": main["load_average"]["start"],
                                                     "end": tis["load_average"]["end"]}, "main": main, "tis": tis}


def opd_grpo_setup(r: dict) -> str:
  m = r["result"]["main"]
  every = m["argv"][m["argv"].index("--eval-every") + 1]
  start = module("compare_opd_grpo").start_accuracy(m)
  return (f"the demo student after its SFT steps (held-out accuracy {start:.3f} at step 0); OPD's learning rate"
          f" {m['optim']['learning_rate']:g}, GRPO's {m['grpo']['learning_rate']:g}, group size"
          f" {m['grpo']['group_size']}; {m['steps']} steps, {m['seeds']} seeds a view, held-out evaluation every"
          f" {every} steps")


def opd_grpo_wall(r: dict) -> str:
  res, la = r["result"], r["result"]["load_average"]  # the two runs' (collect_opd_grpo)
  return (f"{(res['main']['wall_s'] + res['tis']['wall_s']) / 60:.0f} minutes for both runs (load average"
          f" {la['start']} at the start, {la['end']} at the end)")


FIGURES: dict[str, Figure] = {
    "admission": Figure(("python scripts/validate_admission.py --out {out}",), collect_admission,
                        {"calibration": calibration,
                         "admit": lambda r: module(ADMISSION).report(r["result"]["admission"]),
                         "validation": script("validate_admission", "markdown")},
                        images=(("docs/figures/admission_budget.png",
                                 lambda res, path: module(ADMISSION).plot_budget(res["budget"], path)),
                                ("docs/figures/admission_validation.png", lambda res, path: module(
                                    "validate_admission").plot(res["budget"], res["validation"]["rows"], path)))),
    "opd_grpo": Figure((OPD_GRPO + "main", OPD_GRPO + "tis --algos grpo --views 'clean;noise_sigma=0.8;lag=32'"
                        " --config.grpo.is_correction=tis"), collect_opd_grpo,
                       {"setup": opd_grpo_setup, "wall": opd_grpo_wall,
                        "table": script("compare_opd_grpo", "markdown", "main"),
                        "tis": script("compare_opd_grpo", "markdown", "tis"),
                        "counts": script("compare_opd_grpo", "counts", "main")},
                       images=(("docs/figures/opd_grpo_accuracy.png",
                                lambda res, path: module("compare_opd_grpo").plot(res["main"], path)),)),
}
