from __future__ import annotations

import json
import os
import statistics
from statistics import median

from ..common import Figure, _seeds, markdown_table


def collect_admission(out: str) -> dict:
  """scripts/validate_admission.py's three files: the calibration's budget (its points with every seed), the
  admission of the candidates and their trained quality; the budget's config stays in the run folder."""
  budget = json.load(open(os.path.join(out, "calibration", "budget.json")))
  return {"budget": {k: v for k, v in budget.items() if k != "config"},
          "admission": json.load(open(os.path.join(out, "admission", "admission.json"))),
          "validation": json.load(open(os.path.join(out, "validation.json")))}


def calibrate_fit(r: dict) -> str:
  b = r["result"]["budget"]
  fit, n = b["fit"], len(b["points"])
  tol = fit["tolerance"]
  warn = f"; **{b['warning']}**" if b.get("warning") else ""
  bound = (f", the smallest failing view at {fit['smallest_failing_mismatch']:.3g}" if fit["smallest_failing_mismatch"]
           is not None else ": no view failed, so it is a lower bound (the largest mismatch tried)")
  return (f"{b['provenance']['wall_s'] / 60:.1f} minutes for {n} views x {fit['seeds']} seeds; tolerance"
          f" {tol['reverse_kl']:.3g} nats (reverse KL) and {tol['accuracy']:.3g} (accuracy), from the clean seeds'"
          f" std {fit['clean_std']['reverse_kl']:.3g} and {fit['clean_std']['accuracy']:.3g}; **budget"
          f" {b['budget']:.3g}**{bound}{warn}")


def calibrate_caveats(r: dict) -> str:
  """What the budget cannot say (opdjax.analyses.admission.caveats: what `opdjax calibrate` prints and stores)."""
  from opdjax.analyses import admission  # imported where the view needs it: it imports jax

  b = r["result"]["budget"]
  said = admission.caveats(b["points"], b["fit"], b["start"])
  none = "none (a failing view brackets the budget, and the tolerance is under half the gain)"
  return "; ".join(said) if said else none


def calibrate_table(r: dict) -> str:
  b = r["result"]["budget"]
  rows = []
  for p in sorted(b["points"], key=lambda p: p["mismatch"]):
    lo, hi = p["mismatch_ci"]
    ci = f" ({lo:.2g}-{hi:.2g})" if hi > 0 else ""
    rkl = f"{median(p['reverse_kl']):.3g} ({_seeds(p['reverse_kl'], '{:.3g}')})"  # the median admission's rule takes
    rows.append([p["view"], f"{p['mismatch']:.3g}{ci}", rkl, f"{median(p['accuracy']):.3g}",
                 "yes" if p["pass"] else "**no**"])
  return markdown_table(["view", "mismatch (95% CI)", "reverse KL, median (seeds)", "accuracy, median", "pass"], rows)


def admit_table(r: dict) -> str:
  rows = [[c["name"], c["view"], f"{c['mismatch']:.2g}", f"{c['ci_high']:.2g}", c["verdict"],
           f"{c['kv_tokens_ratio']:.3g}", f"{c['seconds']:.2g}"] for c in r["result"]["admission"]["candidates"]]
  return markdown_table(["candidate", "view", "mismatch", "95% upper", "verdict", "KV tokens ratio", "seconds"], rows)


def validate_table(r: dict) -> str:
  rows = []
  for v in r["result"]["validation"]["rows"]:
    right = "yes" if v["agrees"] else "**no** (" + ("too strict" if v["verdict"] == "reject" else "false accept") + ")"
    rows.append([v["name"], v["verdict"], f"{v['reverse_kl_median']:.3g} ({_seeds(v['reverse_kl'], '{:.3g}')})",
                 f"{v['accuracy_median']:.3g}", "yes" if v["quality_ok"] else "no", right])
  return markdown_table(["candidate", "verdict", "reverse KL median (seeds)", "accuracy median",
                         "quality within tolerance", "verdict right"], rows)


def validate_verdict(r: dict) -> str:
  """The study's own rule for claim 5 on these candidates: agreement against accept-all and reject-all."""
  from opdjax.analyses import verdicts  # scipy: imported where a view needs it

  res = r["result"]
  v = verdicts.admission_vs_trivial(res["validation"]["rows"], budget_trusted=not res["budget"].get("warning"))
  ev = v.evidence
  return (f"{ev['agree']} of {ev['total']} verdicts agree with the trained quality; accepting every candidate would"
          f" agree on {ev['accept_all']}, rejecting every one on {ev['reject_all']}; false accepts:"
          f" {', '.join(ev['false_accepts']) or 'none'}. The rule of claim 5: **{v.outcome}** ({v.reason})")


def validate_timing(r: dict) -> str:
  rows = r["result"]["validation"]["rows"]
  admit = [v["admit_s"] for v in rows]
  train = [v["train_s"] for v in rows]
  return (f"{sum(train) / 60:.1f} minutes of training; admission took {min(admit):.2g}-{max(admit):.2g} s per"
          f" candidate against {min(train):.0f}-{max(train):.0f} s of training per candidate")


def _plot_budget(result: dict, path: str) -> str:
  from opdjax.analyses.admission import plot_budget

  return plot_budget(result["budget"], path)


def _plot_validation(result: dict, path: str) -> str:
  import validate_admission  # scripts/: its own figure (imported here only: it imports jax)

  return validate_admission.plot(result["budget"], result["validation"]["rows"], path)


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


def _plot_opd_grpo(result: dict, path: str) -> str:
  import compare_opd_grpo  # scripts/: its own figure (imported here only: it imports jax)

  return compare_opd_grpo.plot(result["main"], path)


def _og_runs(part: dict, algo: str, view: str) -> list[dict]:
  return sorted((x for x in part["rows"] if x["algo"] == algo and x["view"] == view), key=lambda x: x["seed"])


def _og_cells(rows: list[dict], key: str, fmt: str = "{:.3f}") -> str:
  return ", ".join(fmt.format(x[key]) for x in rows)


def _og_collapsed(rows: list[dict]) -> str:
  return ", ".join("**yes**" if x["collapsed"] else "no" for x in rows)


def _og_start_accuracy(part: dict) -> float:
  """The held-out accuracy every run starts from (its step-0 evaluation: the SFT student)."""
  return statistics.median(pts[0]["accuracy"] for pts in part["runs"].values())


def opd_grpo_setup(r: dict) -> str:
  m = r["result"]["main"]
  argv = m["argv"]
  every = argv[argv.index("--eval-every") + 1]
  return (f"the demo student after its SFT steps (held-out accuracy {_og_start_accuracy(m):.3f} at step 0);"
          f" OPD's learning rate {m['optim']['learning_rate']:g}, GRPO's {m['grpo']['learning_rate']:g}, group"
          f" size {m['grpo']['group_size']}; {m['steps']} steps, {m['seeds']} seeds a view, held-out evaluation"
          f" every {every} steps")


def opd_grpo_table(r: dict) -> str:
  """Per view: the engine's mismatch (k3 KL a token, averaged over a run's steps; the median of OPD's runs),
  OPD's and GRPO's final accuracy and grad-norm spikes per seed, and whether each collapsed."""
  m, out = r["result"]["main"], []
  for view in m["views"]:
    opd, grpo = _og_runs(m, "opd", view), _og_runs(m, "grpo", view)
    mismatch = statistics.median(x["train_mismatch_kl_k3"] for x in opd)
    out.append([f"{view} ({mismatch:.2g})", _og_cells(opd, "final_accuracy"), _og_cells(opd, "grad_norm_spikes", "{}"),
                _og_collapsed(opd), _og_cells(grpo, "final_accuracy"), _og_cells(grpo, "grad_norm_spikes", "{}"),
                _og_collapsed(grpo)])
  return markdown_table(["view (mismatch)", "OPD final accuracy", "OPD spikes", "OPD collapsed",
                         "GRPO final accuracy", "GRPO spikes", "GRPO collapsed"], out)


def opd_grpo_tis(r: dict) -> str:
  t, rows = r["result"]["tis"], []
  for view in t["views"]:
    grpo = _og_runs(t, "grpo", view)
    rows.append([view, _og_cells(grpo, "final_accuracy"), _og_cells(grpo, "grad_norm_spikes", "{}"),
                 _og_collapsed(grpo)])
  return markdown_table(["view", "GRPO+TIS final accuracy", "spikes", "collapsed"], rows)


def opd_grpo_wall(r: dict) -> str:
  res = r["result"]
  la = res["load_average"]  # the two runs' (collect_opd_grpo)
  return (f"{(res['main']['wall_s'] + res['tis']['wall_s']) / 60:.0f} minutes for both runs (load average"
          f" {la['start']} at the start, {la['end']} at the end)")


def opd_grpo_counts(r: dict) -> str:
  """The reading's counts: OPD's lowest final accuracy and its collapses; GRPO's runs that ended below the
  start, its collapses, and the views where it spiked most."""
  m = r["result"]["main"]
  start = _og_start_accuracy(m)
  opd = [x for x in m["rows"] if x["algo"] == "opd"]
  grpo = [x for x in m["rows"] if x["algo"] == "grpo"]
  below = [x for x in grpo if x["final_accuracy"] < start]
  worst = max(grpo, key=lambda x: x["grad_norm_spikes"])
  return (f"OPD ended at accuracy {min(x['final_accuracy'] for x in opd):.3f} or above in all {len(opd)} runs and"
          f" collapsed in {sum(x['collapsed'] for x in opd)}; GRPO ended below the start ({start:.3f}) in {len(below)}"
          f" of {len(grpo)} runs ({', '.join(sorted({x['view'] for x in below})) or 'none'}) and collapsed in"
          f" {sum(x['collapsed'] for x in grpo)}; its most spikes were {worst['grad_norm_spikes']} of"
          f" {m['steps']} steps ({worst['view']}), against at most {max(x['grad_norm_spikes'] for x in opd)} for OPD")


FIGURES: dict[str, Figure] = {
    "admission": Figure(("python scripts/validate_admission.py --out {out}",), collect_admission,
                        {"fit": calibrate_fit, "caveats": calibrate_caveats, "calibration": calibrate_table,
                         "admit": admit_table, "validation": validate_table, "verdict": validate_verdict,
                         "timing": validate_timing},
                        images=(("docs/figures/admission_budget.png", _plot_budget),
                                ("docs/figures/admission_validation.png", _plot_validation))),
    "opd_grpo": Figure((OPD_GRPO + "main", OPD_GRPO + "tis --algos grpo --views 'clean;noise_sigma=0.8;lag=32'"
                        " --config.grpo.is_correction=tis"), collect_opd_grpo,
                       {"setup": opd_grpo_setup, "table": opd_grpo_table, "tis": opd_grpo_tis, "wall": opd_grpo_wall,
                        "counts": opd_grpo_counts},
                       images=(("docs/figures/opd_grpo_accuracy.png", _plot_opd_grpo),)),
}
