from __future__ import annotations

import re

from ..common import DocsError, Figure, _read_json

# Result files whose recorded verdicts today's rules no longer all give (opdjax.analyses.rederive): their pages
# show both words (`label`); docs.py --check fails on any other such file (scripts/docs_render/verdict_check.py).
SUPERSEDED: dict[str, str] = {}


def label(r: dict, num: str) -> str:
  """Claim `num`'s label as a page shows it: the recorded one where today's rule on its evidence agrees."""
  from opdjax.analyses.rederive import recorded, shown

  res = r["result"]
  c = res["claims"][num]
  return shown(c, res["claims"], num, res.get("date", "")) if "evidence" in c else recorded(c)


def _claim1_number(ev: dict) -> str:
  """Claim 1's bracket in numbers: the largest passing view below the first clear failure, and that failure."""
  rows = ev["views"]
  fails = [v for v in rows if v["clear_fail"]]
  if not fails:
    top = max(rows, key=lambda v: v["mismatch"])
    return f"no clear failure up to `{top['view']}` (mismatch {top['mismatch']:.3g}); budget {ev['budget']:.3g}"
  below = [v for v in rows if v["pass"] and v["mismatch"] < fails[0]["mismatch"]]
  passes = (f"passes at `{below[-1]['view']}` (mismatch {below[-1]['mismatch']:.3g}), " if below else
            "no view passes below it, ")
  return f"{passes}fails clearly at `{fails[0]['view']}` (mismatch {fails[0]['mismatch']:.3g})"


def _number(num: str, c: dict) -> str:
  """The number behind a claim's verdict, from its evidence."""
  ev = c["evidence"]
  if num == "1":
    return _claim1_number(ev)
  if num == "2":
    d, n = ev.get("difference"), ev.get("heldout_prompts") or (ev.get("heldout") or {}).get("num_prompts", 0)
    if not d:
      return f"{n} held-out prompts, no per-prompt interval"
    return f"recipe - edge KL {d[0]:.3g} {_ci(d)} over {n} held-out prompts"
  if num == "4":
    counted = [v for v in ev["views"] if v["clears_floor"]]
    removes = [v["view"] for v in counted if v.get("tis_removes", v["tis_removed"][1] > 0)]
    kind = ev.get("floor_kind", "another seed").replace(" ", "-")
    return (f"{len(counted)} of {len(ev['views'])} views above the {kind} floor"
            f" ({ev['floor'][2]:.3g}); TIS removes error in {len(removes)} of them")
  n = ev["total"]
  return (f"agree {ev['agree']}/{n} vs accept-all {ev['accept_all']}/{n}, reject-all {ev['reject_all']}/{n};"
          f" false accepts {len(ev['false_accepts'])}")


def reproduction_findings(r: dict) -> str:
  """The findings table's rows of one task: per claim (claim 1 per objective form) the verdict as today's rule
  derives it, the number behind it and the command."""
  import reproduce  # scripts/ (no jax import)

  from opdjax.analyses.rederive import shown

  res = r["result"]
  task, cmd = res["task"], "`" + re.sub(r"--out \S+", "--out DIR", res["command"]) + "`"
  rows = ["| claim (objective) | task | verdict (today's rule) | the number behind it | command |",
          "| --- | --- | --- | --- | --- |"]
  for num, _, title in reproduce.CLAIMS:
    c = res["claims"].get(num)
    if not c or "evidence" not in c:
      rows.append(f"| {num}. {title} | {task} | not run | - | {cmd} |")
      continue
    form = f" ({c['form']})" if num == "1" and c.get("form") else ""
    rows.append(f"| {num}. {title}{form} | {task} | **{label(r, num)}** | {_number(num, c)} | {cmd} |")
    if num == "1":
      for name, f in res.get("forms", {}).items():
        rows.append(f"| 1. {title} ({f['form']}) | {task} | **{shown(f, res['claims'], '1', res['date'])}** |"
                    f" {_number('1', f)} | {cmd} (stage `forms`, `{name}`) |")
  return "\n".join(rows)


def _form_line(name: str, c: dict) -> str:
  """One objective form's bracket: its clear failure with the reverse-KL loss there, or how far none came."""
  ev = c["evidence"]
  fails = [v for v in ev["views"] if v["clear_fail"]]
  if not fails:
    top = max(ev["views"], key=lambda v: v["mismatch"])
    return f"{name}: no clear failure up to `{top['view']}` (mismatch {top['mismatch']:.3g})"
  f = fails[0]
  loss = f["loss"]["reverse_kl"]
  below = [v for v in ev["views"] if v["mismatch"] < f["mismatch"] and not v["pass"]]
  names = _and(["`" + b["view"] + "`" for b in below]) if below else ""
  mms = _and([format(b["mismatch"], ".2g") for b in below]) if below else ""
  early = (f", and {names} (mismatch {mms}) already fail{'s' * (len(below) == 1)} on the median" if below else "")
  return (f"{name}: fails clearly at `{f['view']}` (mismatch {f['mismatch']:.3g}, reverse KL {loss[0]:+.3g}"
          f" {_ci(loss)} against clean){early}")


def repro_objectives(r: dict) -> str:
  """What the objective does to the bracket: claim 1's form and each contrast form, side by side."""
  res = r["result"]
  lines = [_form_line("sampled_rkl, the trainer's log-probs (claim 1)", res["claims"]["1"])]
  names = {"engine_logprobs": "sampled_rkl, the engine's log-probs", "full_rkl": "full_rkl"}
  lines += [_form_line(names.get(n, n), f) for n, f in res.get("forms", {}).items()]
  return "; ".join(lines)


def reproduction_table(r: dict) -> str:
  """scripts/reproduce.py's verdicts, one row a claim, with the stage wall times."""
  import reproduce  # scripts/ (no jax import)

  from opdjax.analyses.verdicts import FALSIFIERS

  res = r["result"]
  lines = ["| claim | paper's statement | result | verdict | would have failed on | stage wall s |",
           "| --- | --- | --- | --- | --- | --- |"]
  for num, stage, title in reproduce.CLAIMS:
    c = res["claims"].get(num)
    wall = res["stages"].get(stage, {}).get("wall_s")
    # A verdict of the rules before opdjax.analyses.verdicts (no falsifier recorded) is not published.
    verdict = ("not run" if not c else label(r, num) if "falsifier" in c else
               f"pending a re-run (the old rule said {c['verdict']})")
    lines.append(f"| {num}. {title} | {reproduce.STATEMENTS[num]} | {c['summary'] if c else 'not run'} |"
                 f" **{verdict}** | {FALSIFIERS[num]} | {wall if wall is not None else '-'} |")
  total = sum(v["wall_s"] for v in res["stages"].values())
  lines += ["", f"All stages: {total / 60:.1f} min ({'complete' if res['complete'] else 'incomplete'}); load average"
            f" {res['load_average']['start']} at start, {res['load_average']['end']} at the end."]
  return "\n".join(lines)


def _ci(x) -> str:
  lo, hi = x[-2], x[-1]
  return f"[{'-inf' if lo is None else f'{lo:.3g}'}, {'inf' if hi is None else f'{hi:.3g}'}]"


def _claim1_evidence(title: str, c: dict) -> list[str]:
  ev = c["evidence"]
  power = c.get("power", {})
  tol = ", ".join(f"{m} {v:.3g}" for m, v in ev["tolerance"].items())
  gain = ", ".join(f"{m} {v:.3g}" for m, v in ev["clean_gain"].items())
  need = ", ".join(f"{m} {v}" for m, v in ev["seeds_needed"].items())
  seeds = f" (clean {ev['clean_seeds']}, the tolerance's n)" if "clean_seeds" in ev else ""
  out = [f"- **{title}** ({c['label']}): {ev['seeds']} seeds a view{seeds} (pilot {power.get('pilot_seeds', '-')};"
         f" needed by the clean spread: {need}; at most {ev['runs'].get('max_seeds', '-')} from the run budget of"
         f" {ev['runs']['budget']}, {ev['runs']['used']} runs used); clean gain over the start {gain};"
         f" tolerance {tol}. Quality loss against clean (median, 95% Welch interval) by mismatch:"]
  for v in ev["views"]:
    loss = "; ".join(f"{m} {x[0]:+.3g} {_ci(x)}" for m, x in v["loss"].items())
    mark = "clear fail" if v["clear_fail"] else "pass" if v["pass"] else "median fails"
    out.append(f"  - `{v['view']}` mismatch {v['mismatch']:.3g}, {v['seeds']} seeds: {loss} ({mark})")
  return out


def reproduction_evidence(r: dict) -> str:
  """The numbers each verdict rule used (opdjax.analyses.verdicts' `evidence`), one list item a claim."""
  claims = r["result"]["claims"]
  out = []
  c = claims.get("1")
  if c and "evidence" in c:
    out += _claim1_evidence("Claim 1", c)
    for name, f in r["result"].get("forms", {}).items():
      out += _claim1_evidence(f"Claim 1, contrast `{name}` ({f['form']})", f)
  c = claims.get("2")
  if c and "evidence" in c:
    ev = c["evidence"]
    ins, held = ev["in_sample"], ev.get("heldout") or {}
    out.append(f"- **Claim 2** ({c['label']}): recipe bf16 layers {ev['recipe_layers']}, edge layers"
               f" {ev['edge_layers']}; in-sample ({ins['num_prompts']} sequences) KL recipe {ins['recipe_kl']:.3g},"
               f" edge {ins['edge_kl']:.3g}, random {ins['random_kl']:.3g}"
               + (f"; held-out ({held['num_prompts']} prompts) recipe {held['recipe_kl']:.3g}, edge"
                  f" {held['edge_kl']:.3g}, random {held['random_kl']:.3g}" if held else "; no held-out prompts"))
  c = claims.get("4")
  if c and "evidence" in c:
    ev = c["evidence"]
    out.append(f"- **Claim 4** ({c['label']}): {ev['replicates']} replicates; noise floor (clean vs clean, another"
               f" seed) {ev['floor'][0]:.3g} {_ci(ev['floor'])}; per view, prefix-shift part (mean, 95% t interval)"
               " and the error TIS removes (raw - TIS):")
    for v in ev["views"]:
      out.append(f"  - `{v['view']}`: prefix shift {v['prefix_shift'][0]:.3g} {_ci(v['prefix_shift'])}"
                 f" ({'clears' if v['clears_floor'] else 'does not clear'} the floor); TIS removes"
                 f" {v['tis_removed'][0]:.3g} {_ci(v['tis_removed'])}")
  c = claims.get("5")
  if c and "evidence" in c:
    ev = c["evidence"]
    n = ev["total"]
    out.append(f"- **Claim 5** ({c['label']}): agreement {ev['agree']}/{n} vs accept-all {ev['accept_all']}/{n} and"
               f" reject-all {ev['reject_all']}/{n}; {ev['degrading']} degrading in training; false accepts:"
               f" {', '.join(ev['false_accepts']) or 'none'}. Candidates:")
    for row in c["rows"]:
      out.append(f"  - `{row['name']}` mismatch {row['mismatch']:.3g}: {row['verdict']}, trained"
                 f" {'within tolerance' if row['quality_ok'] else 'degraded'}")
  return "\n".join(out)


def reproduction_summary(r: dict) -> str:
  """One line of the last run: its wall time, and each claim's outcome."""
  import reproduce  # scripts/ (no jax import)

  res, by = r["result"], {}
  for num, _, _ in reproduce.CLAIMS:
    c = res["claims"].get(num)
    by.setdefault(label(r, num) if c else "not run", []).append(num)
  said = lambda nums: nums[0] if len(nums) == 1 else f"{', '.join(nums[:-1])} and {nums[-1]}"  # noqa: E731
  outcomes = "; ".join(f"claim{'s' * (len(n) > 1)} {said(n)} {'held' if o == 'holds' else o}" for o, n in by.items())
  minutes = sum(v["wall_s"] for v in res["stages"].values()) / 60
  return f"{minutes:.0f} minutes ({'complete' if res['complete'] else 'incomplete'}): {outcomes}"


# The Summary of docs/reproduction.md: the numbers of its sentences, from the claims' `evidence`.
def _claim(r: dict, num: str) -> dict:
  c = r["result"]["claims"].get(num)
  if not c or "evidence" not in c:
    raise DocsError(f"the result has no evidence for claim {num}")
  return c


def _sigma(view: str) -> str:
  return f"{float(view.split('=')[1]):g}"


def _e(x: float) -> str:
  """2 significant digits, the exponent without its leading zero (1.8e-5)."""
  return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.2g}")


def _and(items: list[str]) -> str:
  return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _clean_point(r: dict) -> dict:
  return next(p for p in r["result"]["claims"]["1"]["points"] if p["view"] == "clean")


def repro_power(r: dict) -> str:
  """Claim 1's power step: the pilot's spread, the seeds it called for, and the tolerance at the pilot's
  seeds against the final one (the rule's tolerance at the pilot's std and seeds)."""
  from opdjax.analyses.verdicts import tolerance

  c = _claim(r, "1")
  ev, pw = c["evidence"], c["power"]
  first, last = pw["rounds"][0], pw["rounds"][-1]
  pilot = {m: tolerance(first["clean_std"][m], pw["pilot_seeds"], ev["tolerance_sigmas"], ev["tolerance_floor"][m])[0]
           for m in ev["tolerance"]}
  tol, gain = ev["tolerance"], ev["clean_gain"]
  below = "below" if tol["accuracy"] <= gain["accuracy"] / 2 else "not below"
  return (f"The {pw['pilot_seeds']} clean pilot seeds (accuracy std {first['clean_std']['accuracy']:.3f}) called for"
          f" {first['seeds']} seeds a view; topped up to {last['clean_seeds']}, the clean spread (std"
          f" {last['clean_std']['accuracy']:.3f}) called for {last['seeds']}, so every view ran {ev['seeds']} (the"
          f" {ev['runs']['budget']}-run budget buys {ev['runs']['max_seeds']}). The tolerance fell from"
          f" {pilot['accuracy']:.3f} (the pilot's spread at its {pw['pilot_seeds']} seeds) to {tol['accuracy']:.3f}"
          f" accuracy (reverse KL {pilot['reverse_kl']:.2f} -> {tol['reverse_kl']:.2f}), {below} half the gain over"
          f" the starting student ({gain['accuracy']:.3f} accuracy)")


def repro_ladder(r: dict) -> str:
  """Claim 1's views up to the last one the extension added, and the worst accuracy loss."""
  c = _claim(r, "1")
  views = c["evidence"]["views"]
  by, added = {v["view"]: v for v in views}, c["extension"]["added"]
  top = added[-1] if added else max(views, key=lambda v: v["mismatch"])["view"]
  others = ", ".join(f"{by[a]['mismatch']:.2f} at {_sigma(a)}" for a in added[:-1])
  worst = max(views, key=lambda v: v["loss"]["accuracy"][0])
  loss = worst["loss"]["accuracy"]
  passed = sum(v["pass"] for v in views)
  within = "all" if passed == len(views) else f"{passed} of them"
  return (f"{len(views)} views up to {top}, where the mismatch saturates at {by[top]['mismatch']:.2f} nats/token"
          + (f" ({others})" if others else "") + f", {within} stayed within tolerance with intervals reaching below it"
          f" (the worst, {worst['view']} at {worst['mismatch']:.2f} nats/token, lost {loss[0]:.3f} accuracy"
          f" [{loss[1]:.3f}, {loss[2]:.3f}])")


def repro_chance(r: dict) -> str:
  """Claim 1's accuracy intervals clear of 0, against the count chance gives, and the clean seeds' spread."""
  c = _claim(r, "1")
  ev, views = c["evidence"], c["evidence"]["views"]
  clear = [v for v in views if v["loss"]["accuracy"][1] > 0 or v["loss"]["accuracy"][2] < 0]
  def one(v: dict) -> str:
    _, lo, hi = v["loss"]["accuracy"]
    return (f"{v['view']} at {_e(v['mismatch'])} nats/token, trained *{'better' if hi < 0 else 'worse'}* than clean,"
            f" accuracy interval [{lo:.3f}, {hi:.3f}] of loss")
  each = "; ".join(map(one, clear))
  steps = r["result"]["budgets"].get("calibrate.steps", "-")
  std = c["power"]["rounds"][-1]["clean_std"]["accuracy"]
  return (f"{'One view' if len(clear) == 1 else f'{len(clear)} views'}{', ' + each if clear else ''}:"
          f" {len(clear)} of {len(views)} intervals clear of 0 at 95%, about what chance gives; the clean view's"
          f" {steps}-step outcomes spread over its {ev['seeds']} seeds with an accuracy std of {std:.3f}")


def repro_admission(r: dict) -> str:
  """Claim 5 against the trivial rules."""
  c = _claim(r, "5")
  ev, rows = c["evidence"], c["rows"]
  n, ok = ev["total"], sum(row["quality_ok"] for row in rows)
  seeds = _claim(r, "1")["evidence"]["seeds"]
  return (f"{'All' if ok == n else f'{ok} of'} {n} candidates trained within tolerance (each {seeds} seeds);"
          f" admission agreed on {ev['agree']} of {n} against accept-all's {ev['accept_all']} of {n} and"
          f" reject-all's {ev['reject_all']} of {n}")


def repro_noise_candidates(r: dict) -> str:
  """Claim 5's noise candidates: their sigmas, mismatches and intervals against the budget, and the
  quality a degrading candidate needs (the clean medians past the tolerance)."""
  c1, c5 = _claim(r, "1"), _claim(r, "5")
  rows = [row for row in c5["rows"] if row["view"].startswith("noise_sigma=")]
  budget, tol, clean = c1["evidence"]["budget"], c1["evidence"]["tolerance"], _clean_point(r)
  verdicts = {row["verdict"] for row in rows}
  fate = "so rejected" if verdicts == {"reject"} else "verdicts " + ", ".join(row["verdict"] for row in rows)
  ok = "within tolerance of clean" if all(row["quality_ok"] for row in rows) else "not all within tolerance of clean"
  mm, hi = [row["mismatch"] for row in rows], [row["ci_high"] for row in rows]
  return (f"({', '.join(_sigma(row['view']) for row in rows)}), all at the saturated mismatch"
          f" ({min(mm):.2f}-{max(mm):.2f}; the upper ends of their intervals, {min(hi):.2f}-{max(hi):.2f}, lie above"
          f" the {budget:.3f} budget, {fate}), and trained {ok} (clean accuracy {clean['accuracy_median']:.3f};"
          f" degrading needs below {clean['accuracy_median'] - tol['accuracy']:.3f} or reverse KL above"
          f" {clean['reverse_kl_median'] + tol['reverse_kl']:.2f})")


def repro_tolerance_share(r: dict) -> str:
  ev = _claim(r, "1")["evidence"]
  return f"{ev['tolerance']['accuracy'] / ev['clean_gain']['accuracy']:.0%}"


def repro_prefix_floor(r: dict) -> str:
  """Claim 4: the noise floor and the largest prefix-shift part, with their intervals."""
  ev = _claim(r, "4")["evidence"]
  floor, views = ev["floor"], ev["views"]
  top = max(views, key=lambda v: v["prefix_shift"][0])
  below = all(v["prefix_shift"][0] < floor[0] for v in views)
  where = "lies below its mean" if below else "does not all lie below its mean"
  return (f"{floor[0]:.3g} {_ci(floor)} over {ev['replicates']} replicates and every view's prefix-shift part {where}"
          f" (the largest, {top['view']}, {top['prefix_shift'][0]:.3g} {_ci(top['prefix_shift'])})")


def repro_tis_removes(r: dict) -> str:
  ev = _claim(r, "4")["evidence"]
  names = [v["view"] for v in ev["views"] if v["tis_removed"][1] is not None and v["tis_removed"][1] > 0]
  return f"TIS does remove error, intervals above 0, in {_and(names) if names else 'no view'}"


def repro_recipe(r: dict) -> str:
  layers = _claim(r, "2")["evidence"]["recipe_layers"]
  return f"{len(layers)}-layer recipe (layer{'s' * (len(layers) > 1)} {_and([str(x) for x in layers])})"


def repro_heldout(r: dict) -> str:
  """Claim 2 out of sample: where the recipe was chosen and the held-out KLs it was judged on."""
  ev = _claim(r, "2")["evidence"]
  ins, held = ev["in_sample"], ev["heldout"]
  return (f"The ranking and recipe (bf16 layers {_and([str(x) for x in ev['recipe_layers']])}) were chosen on"
          f" {ins['num_prompts']} prompts; on {held['num_prompts']} other prompts ({held['num_tokens']} tokens) the"
          f" recipe's exact KL is {held['recipe_kl']:.3f} against {held['edge_kl']:.3f} for the same-memory edge layers"
          f" ({_and([str(x) for x in ev['edge_layers']])}) and {held['random_kl']:.3f} for random layers")


def repro_margin(r: dict) -> str:
  held = _claim(r, "2")["evidence"]["heldout"]
  return f"{held['edge_kl'] / held['recipe_kl']:.1f}x"


def repro_cost(r: dict) -> str:
  """The run's stage wall times (with the runs calibration and admission trained) and its load."""
  res = r["result"]
  st, la = res["stages"], res["load_average"]
  c1, c5 = res["claims"].get("1"), res["claims"].get("5")
  runs = {"calibrate": c1["extension"]["runs"] if c1 else None,
          "admission": len(c5["rows"]) * c1["evidence"]["seeds"] if c1 and c5 else None}
  names = {"sensitivity": "sensitivity", "prefix_shift": "prefix shift", "calibrate": "calibration",
           "admission": "admission"}
  parts = [f"{names.get(k, k)} {v['wall_s']:.0f} s" + (f" for {runs[k]} runs" if runs.get(k) else "")
           for k, v in st.items()]
  total = sum(v["wall_s"] for v in st.values()) / 60
  return (f"{total:.1f} min ({', '.join(parts)}) at load average {la['start']} at start and {la['end']} at the end")


FIGURES: dict[str, Figure] = {
    "reproduction_smollm2": Figure(("python scripts/reproduce.py --task smollm2 --out {out}",),
                                   _read_json("reproduction.json"),
                                   {"table": reproduction_table, "evidence": reproduction_evidence,
                                    "summary": reproduction_summary, "findings": reproduction_findings,
                                    "heldout": repro_heldout, "margin": repro_margin, "cost": repro_cost}),
    "reproduction_addition": Figure(("python scripts/reproduce.py --task addition --out {out}",),
                                    _read_json("reproduction.json"),
                                    {"table": reproduction_table, "evidence": reproduction_evidence,
                                     "findings": reproduction_findings, "objectives": repro_objectives,
                                     "power": repro_power, "ladder": repro_ladder,
                                     "chance": repro_chance,
                                     "admission": repro_admission, "noise_candidates": repro_noise_candidates,
                                     "tolerance_share": repro_tolerance_share, "prefix_floor": repro_prefix_floor,
                                     "tis_removes": repro_tis_removes, "recipe": repro_recipe, "cost": repro_cost}),
}
