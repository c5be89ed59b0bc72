"""Every verdict of the study (scripts/reproduce.py) in one place: pure functions from a stage's
results (plain dicts) to a `Verdict`.

A verdict is evidence only if the run could have produced the other one, so each rule names the
outcome that would have made it fail (`FALSIFIER`: the event and the conditions under which the run
could have produced it, each clause both words and a test on the rule's evidence) and returns "does
not hold" exactly when that falsifier is met, "inconclusive" where the run had no power to reach it.
Intervals are two-sided 95% Student-t intervals (`interval`, `welch`), which are wide at the few
seeds a CPU run affords: that is what the data say.

Claim 1 (a mismatch budget exists; quality degrades beyond it), `budget_bracket`:
  quality loss of a view = sign * (median of its seeds - median of the clean seeds) on each metric
  (the calibration fit's own number); its interval adds +-t * sqrt(s_view^2/n + s_clean^2/n) (Welch).
  The tolerance (`tolerance`, the fit's and the re-derivation's one rule): k * s_clean * sqrt(2/n) (k =
  calibrate.tolerance_sigmas, s_clean the clean runs' seed std, n the clean seeds run, top-ups included: not
  the pilot's calibrate.seeds), floored at tolerance_rel * |clean|. Power: the tolerance must be at most
  half the clean runs' gain over the starting student (else a view that undid half of what OPD
  learned would pass); `seeds_needed` is the smallest n for which k * s_clean * sqrt(2/n) is.
  holds: a passing view below the smallest *clearly* failing view (interval low end above the
  tolerance), the fitted budget between them, and no passing view above that failure.
  does not hold: with power, a view passes above a clearly failing one (no budget on this scale
  separates them).
  inconclusive: the clean runs did not learn, the run is underpowered (the reason says whether the
  clean spread or the floor set the tolerance: seeds lower only the former), no view failed clearly
  ("lower bound only", up to the largest mismatch tried), no view passed below the failure ("upper
  bound only"), or the fitted budget is not between the two ("budget not between").
Claim 2 (a measured FP8 recipe beats same-memory edge layers), `recipe_out_of_sample`: the ranking
  is chosen on one prompt set and the recipe's and edge layers' KL measured on held-out prompts
  (at least HELDOUT_MIN_PROMPTS); the 95% t-interval over those prompts of the per-prompt difference
  recipe - edge below 0 holds, at or above 0 does not hold, reaching 0 is inconclusive.
Claim 4 (the error's prefix-shift part TIS cannot remove), `prefix_shift_vs_floor`: a view's
  prefix-shift part counts where its interval across replicates clears the floor's: the clean engine
  with the same seed and prompts (the same random stream), so what clears it is caused by the view; the
  clean engine with another seed (unrelated samples) is kept as an upper reference. holds: a view counts
  and TIS removes error (paired interval of raw - TIS above 0) in at least one counted view; does not
  hold: the falsifier. The part being exactly 0 before the first divergence is true by construction: a
  sanity check only.
Claim 5 (admission predicts training), `admission_vs_trivial`: with a trusted budget, a false accept
  (an accepted candidate that degrades) decides against the claim; agreement with trained quality
  must beat both accept-all and reject-all on candidates that straddle the budget (all fine or all
  degrading cannot tell the rules apart: inconclusive).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from opdjax.analyses.intervals import CONFIDENCE, interval, welch_half_width  # noqa: F401 (verdicts.interval)

OUTCOMES = ("holds", "does not hold", "inconclusive")
QUALITY = {"reverse_kl": +1, "accuracy": -1}  # sign of "worse" (reverse KL up, accuracy down)
HELDOUT_MIN_PROMPTS = 9  # claim 2's interval over held-out prompts needs more than 8 of them


@dataclasses.dataclass(frozen=True)
class Condition:
  """One clause of a falsifier: its words and the same test on a rule's evidence."""

  text: str
  test: Callable[[dict], bool]


@dataclasses.dataclass(frozen=True)
class Falsifier:
  """The result that would have made a claim fail (`event`), in a run that could have produced it
  (`when`). A rule returns "does not hold" exactly when `met(evidence)`: the written falsifier
  (`text`, built from the same clauses) and the rule cannot say different things."""

  event: Condition
  when: tuple[Condition, ...]

  @property
  def text(self) -> str:
    return f"{self.event.text}, {' and '.join(c.text for c in self.when)}"

  def met(self, evidence: dict) -> bool:
    return all(c.test(evidence) for c in self.when) and self.event.test(evidence)


def _pass_above_clear_fail(ev: dict) -> bool:
  fails = [r["mismatch"] for r in ev["views"] if r["clear_fail"]]
  return bool(fails) and any(r["pass"] and r["mismatch"] > min(fails) for r in ev["views"])


FALSIFIER = {
    "1": Falsifier(
        Condition("a view passing the tolerance at a larger mismatch than a view whose quality-loss interval lies "
                  "above the tolerance (no budget separates them)", _pass_above_clear_fail),
        (Condition("in a run with power (the clean runs improved every metric on the starting student by at least "
                   "twice the tolerance)",
                   lambda ev: all(0 < ev["tolerance"][m] * 2 <= ev["clean_gain"][m] for m in ev["tolerance"])),)),
    "2": Falsifier(
        Condition("the recipe's exact KL on held-out prompts at or above the same-memory edge layers' KL there (the "
                  "95% t-interval of the per-prompt difference recipe - edge at or above 0)",
                  lambda ev: ev["difference"] is not None and ev["difference"][1] >= 0),
        (Condition("the recipe keeping other layers than the edge ones", lambda ev: ev["distinct"]),
         Condition(f"over at least {HELDOUT_MIN_PROMPTS} held-out prompts",
                   lambda ev: ev["heldout_prompts"] >= HELDOUT_MIN_PROMPTS))),
    "4": Falsifier(
        Condition("TIS leaving the signal error unchanged or larger (paired interval of raw - TIS at or below 0) in "
                  "a view whose prefix-shift part clears the floor",
                  lambda ev: any(r["clears_floor"] and r["tis_removed"][2] <= 0 for r in ev["views"])),
        (Condition("the prefix-shift part being exactly 0 before the first divergence (the measurement's sanity "
                   "check)", lambda ev: ev["sanity"]["prefix_shift_zero_when_shared"]),)),
    "5": Falsifier(
        Condition("an accepted candidate that degrades in training, or, on candidates that straddle the budget (some "
                  "train within tolerance, some degrade), agreement no better than accept-all or reject-all",
                  lambda ev: bool(ev["false_accepts"]) or (0 < ev["accept_all"] < ev["total"]
                                                           and ev["agree"] <= max(ev["accept_all"], ev["reject_all"]))),
        (Condition("with a trusted budget (its clean runs learned)", lambda ev: ev["budget_trusted"]),)),
}
FALSIFIERS = {num: f.text for num, f in FALSIFIER.items()}  # the written falsifiers (docs/reproduction.md)


@dataclasses.dataclass(frozen=True)
class Verdict:
  claim: str
  outcome: str          # one of OUTCOMES
  reason: str           # one line: why this outcome
  falsifier: str        # what result would have made the claim fail
  evidence: dict        # the numbers the rule used
  label: str = ""       # the outcome with its qualifier, e.g. "inconclusive (lower bound only)"

  def __post_init__(self):
    if self.outcome not in OUTCOMES:
      raise ValueError(f"outcome {self.outcome!r} is not one of {OUTCOMES}")
    if not self.label:
      object.__setattr__(self, "label", self.outcome)

  def to_dict(self) -> dict:
    """Plain JSON: an unbounded interval end (one value) is None."""
    return _finite(dataclasses.asdict(self))


def _finite(x):
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [_finite(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def tolerance(clean_std: float, clean_seeds: int, sigmas: float, floor: float) -> tuple[float, str]:
  """(claim 1's tolerance on a metric, what set it): sigmas * clean_std * sqrt(2 / clean_seeds), with clean_seeds
  the clean view's seeds as run (the spread its median has), floored at `floor` (tolerance_rel * |clean median|)."""
  spread = float(sigmas * clean_std * math.sqrt(2.0 / clean_seeds))
  return max(spread, floor), "clean spread" if spread >= floor else "floor"


def seeds_needed(clean_std: float, gain: float, sigmas: float) -> int | None:
  """Smallest seed count n with sigmas * clean_std * sqrt(2/n) <= gain / 2 (at least 2; None: no gain)."""
  if gain <= 0:
    return None
  return max(2, math.ceil(2 * (2 * sigmas * clean_std / gain) ** 2))


def clean_gain(clean: dict, start: dict, m: str) -> float:
  """How much the clean runs' median improved metric m on the starting student (positive: learned)."""
  return QUALITY[m] * (start[m] - float(np.median(clean[m])))


# --- claim 1 --------------------------------------------------------------------------------------

def view_loss(quality: dict, clean: dict, metrics) -> dict:
  """{metric: (loss, low, high)}: the fit's loss (seed medians) with a Welch half-width."""
  out = {}
  for m in metrics:
    loss = QUALITY[m] * (float(np.median(quality[m])) - float(np.median(clean[m])))
    half = welch_half_width(quality[m], clean[m])
    out[m] = (loss, loss - half, loss + half)
  return out


def budget_bracket(points: list[dict], fit: dict, start: dict, runs: dict) -> Verdict:
  """`points`: calibration points ({view, mismatch, <metric>: [seed values]}, one `clean`), `fit`:
  the calibration's fit (metrics, clean_std, tolerance_sigmas, tolerance_floor, seeds, budget; the tolerance is
  recomputed from the clean seeds run), `start`: the step-0 quality, `runs`: {used, budget,
  max_seeds (optional), ceiling (optional: the bracket's stated ceiling)} training runs."""
  metrics = fit["metrics"]
  clean = next(p for p in points if p["view"] == "clean")
  gain = {m: clean_gain(clean, start, m) for m in metrics}
  rows = []
  for p in sorted((p for p in points if p["view"] != "clean"), key=lambda p: p["mismatch"]):
    loss = view_loss(p, clean, metrics)
    rows.append({"view": p["view"], "mismatch": p["mismatch"], "seeds": len(p[metrics[0]]),
                 "loss": {m: list(v) for m, v in loss.items()}})
  ev = {"clean_std": fit["clean_std"], "clean_seeds": len(clean[metrics[0]]),  # the tolerance's n: seeds run
        "tolerance_sigmas": fit["tolerance_sigmas"], "tolerance_floor": fit["tolerance_floor"], "clean_gain": gain,
        "seeds": fit["seeds"], "runs": runs, "budget": fit["budget"], "views": rows}
  return bracket_verdict(ev)


def bracket_verdict(ev: dict) -> Verdict:
  """Claim 1's decision from its evidence (`budget_bracket`'s: per view its quality-loss intervals, pass and
  clear_fail; the clean std and seeds run, tolerance sigmas and floor, clean gain, seeds, runs and fitted budget):
  what `docs.py --check` re-derives from a result file. The tolerance and seeds needed are recomputed here."""
  falsifier = FALSIFIER["1"]
  std, n, k, gain, runs, rows = (ev[x] for x in ("clean_std", "clean_seeds", "tolerance_sigmas", "clean_gain", "runs",
                                                 "views"))
  rule = {m: tolerance(std[m], n, k, ev["tolerance_floor"][m]) for m in std}
  tol = ev["tolerance"] = {m: t for m, (t, _) in rule.items()}
  set_by = ev["tolerance_set_by"] = {m: b for m, (_, b) in rule.items()}
  need = ev["seeds_needed"] = {m: seeds_needed(std[m], gain[m], k) for m in std}
  metrics, fit = list(tol), {"seeds": ev["seeds"], "budget": ev["budget"]}
  for r in rows:  # from the intervals (a stored JSON interval end of None is unbounded)
    r["pass"] = all(r["loss"][m][0] <= tol[m] for m in metrics)
    r["clear_fail"] = any(r["loss"][m][1] is not None and r["loss"][m][1] > tol[m] for m in metrics)
  source = f"; tolerance set by the {' / '.join(sorted(set(set_by.values())))}"

  def verdict(outcome, reason, label=""):
    return Verdict("1", outcome, reason + source, falsifier.text, ev, label)

  fails = [r for r in rows if r["clear_fail"]]
  if fails:
    ev["smallest_clear_fail"] = {"view": fails[0]["view"], "mismatch": fails[0]["mismatch"]}
  if falsifier.met(ev):
    edge = fails[0]["mismatch"]
    above = [r["view"] for r in rows if r["pass"] and r["mismatch"] > edge]
    return verdict("does not hold", f"{', '.join(above)} passed above the clearly failing {fails[0]['view']} "
                   f"(mismatch {edge:.3g}): quality is not a function of this mismatch scale")
  unlearned = [m for m in metrics if gain[m] <= tol[m]]
  if unlearned:
    return verdict("inconclusive", f"the clean runs did not improve {', '.join(unlearned)} beyond the tolerance: "
                   "no quality loss can be told from no learning")
  weak = [m for m in metrics if tol[m] > gain[m] / 2]
  if weak:
    cap = f"; the run budget of {runs['budget']} runs buys {runs['max_seeds']} a view" if "max_seeds" in runs else ""
    floor = [m for m in weak if set_by.get(m) == "floor"]
    more = (f"; the floor (calibrate.tolerance_rel) sets the tolerance on {', '.join(floor)}: seeds cannot lower "
            "it, longer runs (a larger gain) or a lower floor can" if floor else "")
    return verdict("inconclusive", f"underpowered: the tolerance on {', '.join(weak)} exceeds half the clean runs' "
                   f"gain (clean seeds {n}, needed {', '.join(f'{m} {need[m]}' for m in weak)}{cap}{more})",
                   "inconclusive (underpowered)")
  if not fails:
    top = max(rows, key=lambda r: r["mismatch"]) if rows else None
    reach = f" up to {top['view']} (mismatch {top['mismatch']:.3g})" if top else ""
    why = (f"the ladder reached its ceiling {runs['ceiling']}" if runs.get("ceiling") else
           f"within {runs['used']} of {runs['budget']} runs")
    return verdict("inconclusive", f"no view failed with its interval clear of the tolerance{reach}, {why}: the "
                   f"budget is a lower bound up to {top['mismatch'] if top else 0:.3g}",
                   "inconclusive (lower bound only)")
  edge = fails[0]["mismatch"]
  below = [r for r in rows if r["pass"] and r["mismatch"] < edge]
  if not below:
    return verdict("inconclusive", f"no view passed below the clearly failing {fails[0]['view']}: an upper bound "
                   "only", "inconclusive (upper bound only)")
  lo = max(r["mismatch"] for r in below)
  ev["largest_pass_below"] = {"view": max(below, key=lambda r: r["mismatch"])["view"], "mismatch": lo}
  if not lo <= fit["budget"] < edge:
    return verdict("inconclusive", f"the fitted budget {fit['budget']:.3g} is not between the passing view "
                   f"({lo:.3g}) and the clear failure ({edge:.3g})", "inconclusive (budget not between)")
  return verdict("holds", f"bracketed: passes at {lo:.3g}, budget {fit['budget']:.3g}, fails clearly at {edge:.3g} "
                 f"({fails[0]['view']})")


# --- claim 2 --------------------------------------------------------------------------------------

def recipe_out_of_sample(recipe_layers, edge_layers, in_sample: dict, heldout: dict | None) -> Verdict:
  """`in_sample`/`heldout`: {recipe_kl, edge_kl, random_kl, num_prompts} on the ranking's prompts and
  on prompts the ranking never saw (None: there were none); `heldout` also carries the per-prompt
  token means `recipe_kl_prompts` and `edge_kl_prompts` (the same prompts, paired). The rule: the
  95% t-interval over held-out prompts of recipe - edge (per-prompt KL) below 0 holds, at or above
  0 does not, reaching 0 is inconclusive."""
  falsifier = FALSIFIER["2"]
  paired = bool(heldout) and "recipe_kl_prompts" in heldout
  diff = np.subtract(heldout["recipe_kl_prompts"], heldout["edge_kl_prompts"]) if paired else np.zeros(0)
  ev = {"recipe_layers": list(recipe_layers), "edge_layers": list(edge_layers), "in_sample": in_sample,
        "heldout": heldout, "distinct": sorted(recipe_layers) != sorted(edge_layers),
        "heldout_prompts": int(diff.size), "difference": list(interval(diff)) if diff.size else None}

  def verdict(outcome, reason):
    return Verdict("2", outcome, reason, falsifier.text, ev)

  if falsifier.met(ev):
    m, lo, hi = ev["difference"]
    return verdict("does not hold", f"held-out KL recipe - edge layers {m:.3g} [{lo:.3g}, {hi:.3g}] over "
                   f"{diff.size} unseen prompts: the recipe is no better")
  if not ev["distinct"]:
    return verdict("inconclusive", "the measured ranking chose the edge layers themselves: nothing to compare")
  if not heldout:
    return verdict("inconclusive", "no held-out prompts: the recipe's KL is in-sample only")
  if not paired:
    return verdict("inconclusive", "no per-prompt held-out KLs (a sensitivity result of before the interval)")
  if diff.size < HELDOUT_MIN_PROMPTS:
    return verdict("inconclusive", f"{diff.size} held-out prompts: the interval needs at least "
                   f"{HELDOUT_MIN_PROMPTS}")
  m, lo, hi = ev["difference"]
  if hi < 0:
    return verdict("holds", f"held-out KL {heldout['recipe_kl']:.3g} (recipe) < {heldout['edge_kl']:.3g} (edge "
                   f"layers); per prompt recipe - edge {m:.3g} [{lo:.3g}, {hi:.3g}] over {diff.size} unseen prompts")
  return verdict("inconclusive", f"per prompt recipe - edge {m:.3g} [{lo:.3g}, {hi:.3g}] over {diff.size} unseen "
                 "prompts: the interval reaches 0")


# --- claim 4 --------------------------------------------------------------------------------------

def prefix_shift_vs_floor(views: list[dict], floor: dict) -> Verdict:
  """`views`: [{view, prefix_shift, total_raw, total_tis, prefix_shift_shared}: a list over
  replicates each (the same seeds for every view)]; `floor`: {prefix_shift: [...]}, the clean engine
  against itself with the same seed and prompts (what the view alone causes is above it), and where
  measured `unrelated: [...]`, the clean engine with another seed (an upper reference, not the rule's).
  A view counts where its own interval's low end clears the floor's high end; TIS's removal counts where
  its paired interval (raw - TIS) clears 0."""
  falsifier = FALSIFIER["4"]
  f_mean, _, f_hi = interval(floor["prefix_shift"])
  unrelated = floor.get("unrelated")
  u_hi = interval(unrelated)[2] if unrelated else None
  rows = []
  for v in views:
    ps = interval(v["prefix_shift"])
    removed = interval(np.subtract(v["total_raw"], v["total_tis"]))
    rows.append({"view": v["view"], "prefix_shift": list(ps), "tis_removed": list(removed),
                 "clears_floor": ps[1] > f_hi, "tis_removes": removed[1] > 0,
                 "above_unrelated": None if u_hi is None else ps[1] > u_hi,
                 "shared_zero": all(x == 0.0 for x in v["prefix_shift_shared"])})
  n = min([len(floor["prefix_shift"]), *(len(v["prefix_shift"]) for v in views)])
  ev = {"replicates": n, "floor": [f_mean, *interval(floor["prefix_shift"])[1:]],
        "floor_kind": "same seed" if unrelated is not None else floor.get("kind", "another seed"),
        "unrelated": None if not unrelated else list(interval(unrelated)), "views": rows,
        "sanity": {"prefix_shift_zero_when_shared": all(r["shared_zero"] for r in rows)}}

  def verdict(outcome, reason):
    return Verdict("4", outcome, reason, falsifier.text, ev)

  counted = [r for r in rows if r["clears_floor"]]
  if falsifier.met(ev):
    return verdict("does not hold", f"TIS removes no error in "
                   f"{', '.join(r['view'] for r in counted if r['tis_removed'][2] <= 0)}")
  if not ev["sanity"]["prefix_shift_zero_when_shared"]:
    return verdict("inconclusive", "sanity check failed: the prefix-shift part is not 0 before the first "
                   "divergence (the measurement is broken, not the claim)")
  if n < 2:
    return verdict("inconclusive", "one replicate: no interval to compare with the floor")
  if not counted:
    return verdict("inconclusive", f"no view's prefix-shift interval clears the {ev['floor_kind']} floor's "
                   f"({f_hi:.3g})")
  removes = [r["view"] for r in counted if r["tis_removes"]]
  if not removes:
    return verdict("inconclusive", f"prefix-shift part above the floor in {', '.join(r['view'] for r in counted)}, "
                   "but TIS's removed error has an interval reaching 0 in each")
  unclear = [r["view"] for r in counted if not r["tis_removes"]]
  return verdict("holds", f"prefix-shift part above the {ev['floor_kind']} floor ({f_hi:.3g}) in {len(counted)} of "
                 f"{len(rows)} views ({', '.join(r['view'] for r in counted)}); TIS removes error (interval above 0)"
                 f" in {', '.join(removes)}" + (f"; unclear in {', '.join(unclear)}" if unclear else ""))


# --- claim 5 --------------------------------------------------------------------------------------

def admission_vs_trivial(rows: list[dict], budget_trusted: bool) -> Verdict:
  """`rows`: [{name, verdict: accept|reject, quality_ok: trained within tolerance}] (one a candidate).
  A false accept decides against the claim whether or not the candidates straddle (it is the claim's
  own "no false accepts"); agreement is compared with the trivial rules only on straddling candidates."""
  falsifier = FALSIFIER["5"]
  n = len(rows)
  agree = sum((r["verdict"] == "accept") == r["quality_ok"] for r in rows)
  ok = sum(r["quality_ok"] for r in rows)
  false_accepts = [r["name"] for r in rows if r["verdict"] == "accept" and not r["quality_ok"]]
  ev = {"total": n, "agree": agree, "accept_all": ok, "reject_all": n - ok, "degrading": n - ok,
        "false_accepts": false_accepts, "accepts": sum(r["verdict"] == "accept" for r in rows),
        "budget_trusted": budget_trusted}

  def verdict(outcome, reason):
    return Verdict("5", outcome, reason, falsifier.text, ev)

  best = max(ok, n - ok)
  if falsifier.met(ev):
    if false_accepts:
      return verdict("does not hold", f"false accepts: {', '.join(false_accepts)}")
    return verdict("does not hold", f"{agree}/{n} agree, no better than the best trivial rule ({best}/{n})")
  if not budget_trusted:
    return verdict("inconclusive", "the budget is untrusted (its clean runs did not learn): nothing to predict")
  if ok in (0, n):
    return verdict("inconclusive", f"the candidates do not straddle the budget ({ok} of {n} trained within "
                   "tolerance): a trivial rule scores perfectly")
  return verdict("holds", f"{agree}/{n} agree vs accept-all {ok}/{n}, reject-all {n - ok}/{n}; no false accept "
                 f"among {n - ok} degrading")
