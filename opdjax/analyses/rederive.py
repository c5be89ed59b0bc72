"""Every verdict a reproduction result records, re-derived with today's rule (opdjax.analyses.verdicts) from
the evidence stored beside it, so a rendered verdict cannot outlive its rule: `scripts/docs.py --check` fails
naming the file and claim where the recorded label and the re-derived one differ, and the pages render a
result a registry marks superseded with both words, never the old one alone.

What each claim is re-derived from (all inside the result file):
  1 (and each contrast form of `forms`): `bracket_verdict` on the claim's evidence (per view the quality-loss
    intervals, from which pass and clear failure are recomputed; the tolerance, clean gain, seeds, runs, budget);
  2: `recipe_out_of_sample` on the recipe's and edge layers and the in-sample and held-out KLs;
  4: `prefix_shift_vs_floor` on the per-replicate parts of every view and the floor(s);
  5: `admission_vs_trivial` on the candidates' verdicts and trained quality, and whether the budget was trusted.
"""

from __future__ import annotations

from opdjax.analyses import verdicts


def derive(num: str, claim: dict, claims: dict) -> verdicts.Verdict:
  """Claim `num`'s verdict by today's rule from `claim`'s stored evidence (`claims`: the file's others)."""
  ev = claim["evidence"]
  if num == "1":
    return verdicts.bracket_verdict({k: v for k, v in ev.items() if k not in ("smallest_clear_fail",
                                                                                "largest_pass_below")})
  if num == "2":
    return verdicts.recipe_out_of_sample(ev["recipe_layers"], ev["edge_layers"], ev["in_sample"], ev.get("heldout"))
  if num == "4":
    return verdicts.prefix_shift_vs_floor(claim["views"], claim["noise_floor"])
  if num == "5":
    trusted = ev.get("budget_trusted", bool(claims.get("1", {}).get("converged")))
    return verdicts.admission_vs_trivial(claim["rows"], trusted)
  raise KeyError(f"no rule for claim {num!r}")


def recorded(claim: dict) -> str:
  return claim.get("label") or claim["verdict"]


def stale(result: dict) -> list[tuple[str, str, str]]:
  """(where, recorded label, today's label) for every claim (and contrast form) whose label differs."""
  out = []
  claims = result.get("claims", {})
  items = [(num, c) for num, c in claims.items()] + [(f"1 ({name})", c) for name, c in result.get("forms", {}).items()]
  for where, c in items:
    if "evidence" not in c:
      out.append((where, recorded(c), "no evidence recorded"))
      continue
    try:
      now = derive(where.split(" ")[0], c, claims).label
    except (KeyError, TypeError, IndexError) as e:  # evidence of an older shape than the rule reads
      now = f"not derivable from its evidence ({type(e).__name__}: {e})"
    if now != recorded(c):
      out.append((where, recorded(c), now))
  return out


def shown(claim: dict, claims: dict, num: str, date: str) -> str:
  """The label a page shows: the recorded one where today's rule agrees, else both words."""
  try:
    now = derive(num, claim, claims).label
  except (KeyError, TypeError, IndexError):
    now = "not derivable from its evidence"
  was = recorded(claim)
  return was if now == was else f"superseded (recorded {was} on {date[:10]}; today's rule on its evidence: {now})"
