"""scripts/reproduce.py's result rendered: the verdict table with its falsifiers, the findings rows, the evidence
behind each verdict, the objectives' brackets and a one-line summary. reproduce.py's reproduction.md carries the
evidence; docs/reproduction.md and docs/guide.md render the rest from the signed result files (scripts/docs.py).
Every label shown is today's rule on the recorded evidence (opdjax.analyses.rederive.shown)."""

from __future__ import annotations

import re


def label(res: dict, num: str) -> str:
  """Claim `num`'s label as a page shows it: the recorded one where today's rule on its evidence agrees."""
  from opdjax.analyses.rederive import recorded, shown

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


def findings(res: dict) -> str:
  """The findings table's rows of one task: per claim (claim 1 per objective form) the verdict as today's rule
  derives it, the number behind it and the command."""
  import reproduce  # scripts/ (no jax import)

  from opdjax.analyses.rederive import shown

  task, cmd = res["task"], "`" + re.sub(r"--out \S+", "--out DIR", res["command"]) + "`"
  rows = ["| claim (objective) | task | verdict (today's rule) | the number behind it | command |",
          "| --- | --- | --- | --- | --- |"]
  for num, _, title in reproduce.CLAIMS:
    c = res["claims"].get(num)
    if not c or "evidence" not in c:
      rows.append(f"| {num}. {title} | {task} | not run | - | {cmd} |")
      continue
    form = f" ({c['form']})" if num == "1" and c.get("form") else ""
    rows.append(f"| {num}. {title}{form} | {task} | **{label(res, num)}** | {_number(num, c)} | {cmd} |")
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


def objectives(res: dict) -> str:
  """What the objective does to the bracket: claim 1's form and each contrast form, side by side."""
  lines = [_form_line("sampled_rkl, the trainer's log-probs (claim 1)", res["claims"]["1"])]
  names = {"engine_logprobs": "sampled_rkl, the engine's log-probs", "full_rkl": "full_rkl"}
  lines += [_form_line(names.get(n, n), f) for n, f in res.get("forms", {}).items()]
  return "; ".join(lines)


def table(res: dict) -> str:
  """scripts/reproduce.py's verdicts, one row a claim, with the stage wall times."""
  import reproduce  # scripts/ (no jax import)

  from opdjax.analyses.verdicts import FALSIFIERS

  lines = ["| claim | paper's statement | result | verdict | would have failed on | stage wall s |",
           "| --- | --- | --- | --- | --- | --- |"]
  for num, stage, title in reproduce.CLAIMS:
    c = res["claims"].get(num)
    wall = res["stages"].get(stage, {}).get("wall_s")
    # A verdict of the rules before opdjax.analyses.verdicts (no falsifier recorded) is not published.
    verdict = ("not run" if not c else label(res, num) if "falsifier" in c else
               f"pending a re-run (the old rule said {c['verdict']})")
    lines.append(f"| {num}. {title} | {reproduce.STATEMENTS[num]} | {c['summary'] if c else 'not run'} |"
                 f" **{verdict}** | {FALSIFIERS[num]} | {wall if wall is not None else '-'} |")
  total = sum(v["wall_s"] for v in res["stages"].values())
  lines += ["", f"All stages: {total / 60:.1f} min ({'complete' if res['complete'] else 'incomplete'}); load average"
            f" {res['load_average']['start']} at start, {res['load_average']['end']} at the end."]
  return "\n".join(lines)


def _and(items: list[str]) -> str:
  return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


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


def evidence(res: dict) -> str:
  """The numbers each verdict rule used (opdjax.analyses.verdicts' `evidence`), one list item a claim."""
  claims = res["claims"]
  out = []
  c = claims.get("1")
  if c and "evidence" in c:
    out += _claim1_evidence("Claim 1", c)
    for name, f in res.get("forms", {}).items():
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


def summary(res: dict) -> str:
  """One line of the last run: its wall time, and each claim's outcome."""
  import reproduce  # scripts/ (no jax import)

  by = {}
  for num, _, _ in reproduce.CLAIMS:
    c = res["claims"].get(num)
    by.setdefault(label(res, num) if c else "not run", []).append(num)
  outcomes = "; ".join(f"claim{'s' * (len(n) > 1)} {_and(n)} {'held' if o == 'holds' else o}" for o, n in by.items())
  minutes = sum(v["wall_s"] for v in res["stages"].values()) / 60
  return f"{minutes:.0f} minutes ({'complete' if res['complete'] else 'incomplete'}): {outcomes}"
