"""Mismatch budget calibration (`opdjax calibrate`) and the admission check (`opdjax admit`).

Both measure mismatch on one scale with one protocol: from the student the run starts with,
`warmup_steps` clean OPD steps fill a params history (so `lag=k` is a real k-step-old version),
then the engine view generates on the first `num_prompts` held-out prompts with a fixed seed and
the trainer re-scores the same tokens: the token mean of the exact full-vocabulary
KL(engine || trainer). Calibration trains short OPD runs at each view (several seeds), relates
that mismatch to the final quality, and fits the budget; admission measures a candidate's
mismatch in seconds, with a bootstrap interval over sequences, and accepts it when the interval's
upper end is within the budget.

The budget fit: a view's quality is the median over its seeds of the final held-out reverse KL
and verifier accuracy (short OPD runs converge at a random moment, and one late seed would
dominate a mean of three); s = the seed standard deviation of the clean runs; tolerance =
max(tolerance_sigmas * s * sqrt(2 / n), tolerance_rel * |clean median|), n the clean seeds run; a view passes when
its quality loss against clean (reverse KL up, accuracy down) is within the tolerance on every
metric. (Not a std pooled over all views: unstable views would widen their own tolerance.)
The budget is the largest mismatch among passing views that lies below the smallest failing
mismatch (every view with less mismatch passed).
"""

from __future__ import annotations

import datetime
import os
import time

import ml_collections
import numpy as np

from opdjax.analyses import bracket, reporting
from opdjax.analyses.mismatch import Measurer, parse_views, warmup_history
from opdjax.analyses.sweep import final_quality, sweep_config, train_run
from opdjax.analyses.verdicts import QUALITY, clean_gain, seeds_needed
from opdjax.analyses.verdicts import tolerance as verdicts_tolerance
from opdjax.config.schema import Config, build
from opdjax.errors import UserError
from opdjax.models.quant import QuantFormat
from opdjax.pipeline.checkpoint import package_versions
from opdjax.pipeline.guards import BUDGET_FORMAT, load_budget, params_fingerprint
from opdjax.pipeline.session import Session
from opdjax.progress import bar as progress_bar
from opdjax.views.view import EngineView


def require_clean(views: list[EngineView], what: str) -> list[EngineView]:
  if EngineView() not in views:
    raise UserError(f"{what} has no 'clean' view: quality is compared against the clean engine.")
  return views


def family(view: EngineView) -> str:
  names = list(view.sources())
  return names[0] if len(names) == 1 else ("clean" if not names else "+".join(names))


def bootstrap_interval(kl_BxL: np.ndarray, mask_BxL: np.ndarray, n: int, confidence: float, seed: int = 0):
  """(token mean, low, high) of the masked mean, resampling sequences with replacement."""
  sums = (kl_BxL * mask_BxL).sum(-1)
  counts = mask_BxL.sum(-1)
  mean = float(sums.sum() / max(counts.sum(), 1.0))
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(sums), (n, len(sums)))
  boot = sums[idx].sum(-1) / np.maximum(counts[idx].sum(-1), 1.0)
  alpha = (1 - confidence) / 2
  return mean, float(np.quantile(boot, alpha)), float(np.quantile(boot, 1 - alpha))


class Calibration:
  """The measurement protocol shared by `calibrate` and `admit`."""

  def __init__(self, session: Session, warmup_steps: int, num_prompts: int, seed: int, max_lag: int):
    """`max_lag <= warmup_steps`, checked by the caller where the views arrive."""
    self.protocol = {"warmup_steps": warmup_steps, "num_prompts": num_prompts, "seed": seed}
    self.state, self.history = warmup_history(session, warmup_steps, max_lag)
    self.measurer = Measurer(session)
    self.prompts = session.task.eval_set()[0][:num_prompts]
    self.seed = seed

  def kl_tokens(self, view: EngineView):
    return self.measurer.exact_kl_tokens(view, self.history, self.state.params, self.prompts, self.seed)


# --- calibrate ---------------------------------------------------------------------------------

def judge(quality: dict[str, list[float]], clean: dict[str, list[float]], fit: dict) -> tuple[dict, bool]:
  """(quality loss per metric of seed medians against clean, within the fit's tolerance on every metric)."""
  loss = {m: float(QUALITY[m] * (np.median(quality[m]) - np.median(clean[m]))) for m in fit["metrics"]}
  return loss, all(loss[m] <= fit["tolerance"][m] for m in fit["metrics"])


def fit_budget(points: list[dict], seeds: int, tolerance_sigmas: float, tolerance_rel: float) -> dict:
  """Marks each point pass/fail against the clean one and returns the fit (see the module doc)."""
  clean = next(p for p in points if p["view"] == "clean")
  metrics = [m for m in QUALITY if all(p.get(m) for p in points)]
  fit = {"metrics": metrics, "seeds": seeds, "tolerance_sigmas": tolerance_sigmas, "tolerance_rel": tolerance_rel,
         "clean_std": {}, "tolerance": {}}
  fit["tolerance_spread"], fit["tolerance_floor"], fit["tolerance_set_by"] = {}, {}, {}
  fit["clean_seeds"] = n = len(clean[metrics[0]])  # the tolerance's n: the clean seeds run, not `seeds`
  for m in metrics:
    s = float(np.std(clean[m], ddof=1))
    fit["clean_std"][m] = s
    fit["tolerance_spread"][m] = verdicts_tolerance(s, n, tolerance_sigmas, 0.0)[0]
    fit["tolerance_floor"][m] = floor = float(tolerance_rel * abs(np.median(clean[m])))
    fit["tolerance"][m], fit["tolerance_set_by"][m] = verdicts_tolerance(s, n, tolerance_sigmas, floor)
  for p in points:
    p["quality_loss"], p["pass"] = judge(p, clean, fit)
  failing = [p["mismatch"] for p in points if not p["pass"]]
  limit = min(failing) if failing else float("inf")
  passing = [p["mismatch"] for p in points if p["pass"] and p["mismatch"] < limit]
  fit["budget"] = max(passing) if passing else 0.0
  fit["smallest_failing_mismatch"] = None if not failing else limit
  fit["monotone"] = not any(p["pass"] for p in points if p["mismatch"] > limit)  # no pass above a failure
  return fit


def untrusted(points: list[dict], fit: dict, start: dict) -> str:
  """Why the calibration cannot be trusted ('' when it can): the clean runs must improve on the
  starting student by more than the tolerance on every quality metric, or no failure means anything."""
  clean = next(p for p in points if p["view"] == "clean")
  for m in fit["metrics"]:
    gain = clean_gain(clean, start, m)
    if gain <= fit["tolerance"][m]:
      return (f"the clean runs did not improve {m} beyond the tolerance ({start[m]:.4g} at step 0 -> median"
              f" {np.median(clean[m]):.4g}; tolerance {fit['tolerance'][m]:.4g})")
  return ""


def caveats(points: list[dict], fit: dict, start: dict) -> list[str]:
  """What the budget cannot say, in the study's terms (opdjax.analyses.verdicts, claim 1): no failing view
  makes it a lower bound (the largest mismatch tried), and a tolerance above half the clean runs' gain lets
  a view undo half of what OPD learned and still pass (with the seeds that would bring it under)."""
  out = []
  if fit["smallest_failing_mismatch"] is None:
    out.append(f"no view failed: the budget {fit['budget']:.4g} is the largest mismatch tried, a lower bound")
  clean = next(p for p in points if p["view"] == "clean")
  for m in fit["metrics"]:
    gain = clean_gain(clean, start, m)
    if 0 < gain < 2 * fit["tolerance"][m]:
      n = seeds_needed(fit["clean_std"][m], gain, fit["tolerance_sigmas"])  # the study's power rule
      out.append(f"the {m} tolerance {fit['tolerance'][m]:.4g} is over half the clean runs' gain {gain:.4g}: a view"
                 f" could undo half of what OPD learned and pass; about {n} seeds a view (now {len(clean[m])}) or"
                 " longer runs would bring it under")
  return out


def calibrate(cfg: Config, out_dir: str, progress: bool = True, power=None) -> dict:
  """`power(clean_point, start) -> {"seeds": n, ...}`: after the clean view's `calibrate.seeds` pilot
  runs, the seed count every view gets (the clean view is topped up to n and asked again until n stops
  growing; never fewer than the pilot's). With `calibrate.bracket`, after the configured views the
  steps of `opdjax.analyses.bracket.next_step` (more seeds for a straddling view, the next noise rung)
  run until it stops; budget.json's `bracket` records both sides."""
  c = cfg.calibrate
  views, max_lag = parse_views(c.views, c.warmup_steps, "calibrate")
  require_clean(views, f"calibrate.views={c.views!r}")
  if c.seeds < 2:
    raise UserError(f"calibrate.seeds={c.seeds}: the tolerance needs the seed variance; use at least 2 seeds.")
  path = os.path.join(out_dir, "budget.json")
  if os.path.exists(path):
    raise FileExistsError(f"{path} exists; pass a new --out folder (nothing was overwritten).")
  t0 = time.time()
  session = Session(sweep_config(cfg, c.steps, c.eval_every), progress=progress)
  cal = Calibration(session, c.warmup_steps, c.num_prompts, c.seed, max_lag)
  points, curves = [], {}

  def run_seeds(point, view, seeds):  # seeds len(point's runs) .. seeds-1; returns the step-0 quality
    start = None
    for s in range(len(point["reverse_kl"]), seeds):  # seed s is the `opdjax train` run with seed=cfg.seed + s
      records = train_run(session, view, seed=cfg.seed + s, desc=f"{view} seed {cfg.seed + s}")
      start = records[0]
      curves[f"{view}|{s}"] = records
      for k, v in final_quality(records).items():
        point[k].append(v)
      point["train_mismatch_kl_k3"].append(float(np.mean([r["mismatch_kl_k3_tok"] for r in records[1:]])))
    return start

  def add(view, seeds):
    kl, mask = cal.kl_tokens(view)
    mean, lo, hi = bootstrap_interval(kl, mask, cfg.admit.bootstrap, cfg.admit.confidence)
    point = {"view": str(view), "family": family(view), "mismatch": mean, "mismatch_ci": [lo, hi],
             "reverse_kl": [], "accuracy": [], "train_mismatch_kl_k3": []}
    points.append(point)
    return run_seeds(point, view, seeds)

  # The clean view first: its seeds' spread sets the seed count of every view (the power rule).
  clean_view = next(v for v in views if str(v) == "clean")
  seeds = c.seeds
  start = add(clean_view, seeds)
  rounds = []
  while power is not None:
    want = power(points[0], start)
    rounds.append({"clean_seeds": seeds, **want})
    if want["seeds"] <= seeds:
      break
    seeds = want["seeds"]
    run_seeds(points[0], clean_view, seeds)
  for view in progress_bar([v for v in views if str(v) != "clean"], desc="calibrate views", enabled=progress):
    add(view, seeds)
  fit = fit_budget(points, seeds, c.tolerance_sigmas, c.tolerance_rel)
  added, steps, stop = [], [], None
  while c.bracket:
    step = bracket.next_step(points, fit, seeds, max(c.max_seeds, seeds), c.bracket_factor, c.bracket_ceiling,
                             c.max_runs)
    steps.append(step.to_dict())
    if step.kind == "stop":
      stop = step
      break
    if step.kind == "seeds":
      point = next(p for p in points if p["view"] == step.view)
      run_seeds(point, EngineView.parse(step.view), step.seeds)
    else:
      add(EngineView.parse(step.view), step.seeds)
      added.append(step.view)
    fit = fit_budget(points, seeds, c.tolerance_sigmas, c.tolerance_rel)
  session.close()
  why = untrusted(points, fit, start)
  if why and not c.force:
    raise UserError(f"no budget written: {why}. Raise calibrate.steps (now {c.steps}) so the clean runs learn,"
                    " or pass --config.calibrate.force=true to write it anyway.")
  budget = {
      "format": BUDGET_FORMAT,
      "budget": fit["budget"],
      "scale": "token mean of exact KL(engine || trainer) on the calibration batch",
      "fit": fit, "points": points, "protocol": cal.protocol, "start": {m: start[m] for m in fit["metrics"]},
      "extension": {"max_runs": c.max_runs if c.bracket else None, "runs": bracket.runs_used(points, fit),
                    "added": added},
      "bracket": None if stop is None else {**bracket.sides(points, fit, stop, c.bracket_ceiling), "steps": steps},
      "power": {"pilot_seeds": c.seeds, "seeds": seeds, "rounds": rounds},
      "warning": why or None,
      "caveats": caveats(points, fit, start),
      "student_fingerprint": params_fingerprint(session.student_params),
      "config": cfg.to_dict(),
      "provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "versions": package_versions(), "wall_s": round(time.time() - t0, 1),
                     "compiled": {**session.compiled_counts(), **cal.measurer.compiled()}},
  }
  os.makedirs(out_dir, exist_ok=True)
  reporting.write_json(os.path.join(out_dir, "curves.json"), curves)
  rows = [{"view": p["view"], "family": p["family"], "mismatch": p["mismatch"], "ci_low": p["mismatch_ci"][0],
           "ci_high": p["mismatch_ci"][1], **{f"{m}_median": float(np.median(p[m])) for m in fit["metrics"]},
           **{f"{m}_std": float(np.std(p[m], ddof=1)) for m in fit["metrics"]}, "pass": p["pass"]} for p in points]
  reporting.write_csv(os.path.join(out_dir, "calibration.csv"), rows)
  reporting.write_text(os.path.join(out_dir, "calibration.md"), reporting.markdown_table(rows) + "\n")
  plot_budget(budget, os.path.join(out_dir, "budget.png"))
  reporting.write_json(path, budget)  # last: budget.json present means the calibration finished
  return budget


def plot_budget(budget: dict, path: str, candidates: list[dict] | None = None) -> str:
  """Quality vs mismatch of the calibration points (one panel per metric) and, when given, a panel
  of the candidates: one row each, its interval as a bar and its name as the row label, so
  intervals near zero and their labels stay readable (values below the floor are drawn at it)."""
  metrics = budget["fit"]["metrics"]
  cands = candidates or []
  positive = [v for p in budget["points"] for v in (p["mismatch"],) if v > 0]
  positive += [v for c in cands for v in (c["ci_low"], c["mismatch"]) if v > 0]
  floor = max(min(positive) / 10, 1e-9) if positive else 1e-9
  rows = 2 if cands else 1
  fig, axes = reporting.figure(rows, len(metrics), figsize=(5.5 * len(metrics), 4 + 0.35 * len(cands) * (rows - 1)),
                               squeeze=False, sharex="col",
                               gridspec_kw={"height_ratios": [4, max(1.0, 0.35 * len(cands))]} if cands else None)
  markers = {"clean": "s", "noise": "o", "lag": "^", "weights": "D", "kv_cache": "v"}
  for col, m in enumerate(metrics):
    ax = axes[0][col]
    for p in budget["points"]:
      x = max(p["mismatch"], floor)
      color = "tab:green" if p["pass"] else "tab:red"
      ax.scatter([x] * len(p[m]), p[m], marker=".", color=color, alpha=0.4, s=12)  # each seed
      ax.scatter([x], [np.median(p[m])], marker=markers.get(p["family"], "o"), color=color, s=30)
      ax.annotate(p["view"], (x, np.median(p[m])), fontsize=6, xytext=(3, 3), textcoords="offset points")
    clean = np.median(next(p for p in budget["points"] if p["view"] == "clean")[m])
    tol = budget["fit"]["tolerance"][m]
    ax.axhline(clean + QUALITY[m] * tol, color="gray", ls=":", label="tolerance")
    ax.axvline(max(budget["budget"], floor), color="black", ls="--", label=f"budget {budget['budget']:.3g}")
    ax.set_xscale("log")
    ax.set_ylabel(f"final held-out {m}\n(median of seeds; dots: each seed)", fontsize=8)
    if m == "reverse_kl":
      ax.set_yscale("log")
    ax.legend(fontsize=7)
    if cands:
      cax = axes[1][col]
      for i, c in enumerate(cands):
        color = "tab:blue" if c["verdict"] == "accept" else "tab:orange"
        lo, mid, hi = (max(c[k], floor) for k in ("ci_low", "mismatch", "ci_high"))
        cax.plot([lo, hi], [i, i], color=color, lw=4, solid_capstyle="butt")
        cax.plot([mid], [i], "k|", ms=10)
      cax.axvline(max(budget["budget"], floor), color="black", ls="--")
      cax.set_yticks(range(len(cands)), [f"{c['name']} ({c['verdict']})" for c in cands], fontsize=7)
      cax.set_ylim(-0.7, len(cands) - 0.3)
      cax.set_xlabel("exact KL(engine || trainer) per token; bars: 95% intervals", fontsize=8)
    else:
      ax.set_xlabel("mismatch: exact KL(engine || trainer) per token")
  return reporting.save_figure(fig, path)


# --- admit -------------------------------------------------------------------------------------

def read_candidates(path: str) -> list[tuple[str, EngineView]]:
  """`NAME: ENGINE-VIEW` per line ('#' comments and blank lines ignored)."""
  if not os.path.exists(path):
    raise UserError(f"candidates file {path} does not exist.")
  out = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      line = line.split("#", 1)[0].strip()
      if not line:
        continue
      name, sep, spec = line.partition(":")
      if not sep or not name.strip():
        raise UserError(f"{path}:{n}: {line!r} is not 'NAME: ENGINE-VIEW'"
                        " (e.g. 'fp8-kv: weights=fp8,kv_quant=fp8_e4m3').")
      try:
        view = EngineView.parse(spec)
        for _, fmt in view.recipe(num_layers=1) or []:
          QuantFormat.parse(fmt)
        out.append((name.strip(), view))
      except UserError as e:
        raise UserError(f"{path}:{n}: candidate {name.strip()!r}: {e}") from None
  if not out:
    raise UserError(f"{path} lists no candidates.")
  names = [n for n, _ in out]
  if len(set(names)) != len(names):
    raise UserError(f"{path}: candidate names repeat ({', '.join(sorted({n for n in names if names.count(n) > 1}))}).")
  return out


def admit(budget_path: str, candidates_path: str, out_dir: str | None = None, overrides: dict | None = None,
          progress: bool = True) -> dict:
  from opdjax.analyses.capacity import capacity_for_view
  from opdjax.config.loader import apply_overrides

  budget = load_budget(budget_path)
  candidates = read_candidates(candidates_path)
  # Only admit.* may change: anything else (sampling, optimizer, models) would move the scale away
  # from the one the budget was calibrated on.
  other = sorted(k for k in overrides or {} if not k.startswith("admit."))
  if other:
    raise UserError(f"admit runs on the config stored in {budget_path}; only --config.admit.* may be overridden"
                    f" (got {', '.join(other)}). Calibrate again to change the rest.")
  cfg = build(apply_overrides(ml_collections.ConfigDict(budget["config"]), overrides or {}))
  proto = budget["protocol"]
  # The calibration's own session: its warm-up trained with the sweep's schedule.
  session = Session(sweep_config(cfg, cfg.calibrate.steps, cfg.calibrate.eval_every), progress=False)
  if params_fingerprint(session.student_params) != budget["student_fingerprint"]:
    raise UserError(f"{budget_path} was calibrated on a different student than this config loads; calibrate again"
                    " for this student.")
  max_lag = max(v.lag for _, v in candidates)
  if max_lag > proto["warmup_steps"]:
    raise UserError(f"a candidate has lag {max_lag} but the budget's protocol has warmup_steps="
                    f"{proto['warmup_steps']}; calibrate with calibrate.warmup_steps >= {max_lag}.")
  capacity = {}
  for name, view in candidates:  # every candidate is checked before the (longer) measurements start
    try:
      view.model(session.student)
      capacity[name] = capacity_for_view(session.student.cfg, view, cfg.admit.memory_gib)
    except (UserError, ValueError) as e:
      raise UserError(f"{candidates_path}: candidate {name!r} ({view}): {e}") from None
  t0 = time.time()
  cal = Calibration(session, proto["warmup_steps"], proto["num_prompts"], proto["seed"], max_lag)
  setup_s = time.time() - t0
  rows = []
  for name, view in progress_bar(candidates, desc="candidates", enabled=progress):
    t = time.time()
    kl, mask = cal.kl_tokens(view)
    mean, lo, hi = bootstrap_interval(kl, mask, cfg.admit.bootstrap, cfg.admit.confidence)
    cap = capacity[name]
    rows.append({"name": name, "view": str(view), "mismatch": mean, "ci_low": lo, "ci_high": hi,
                 "budget": budget["budget"], "verdict": "accept" if hi <= budget["budget"] else "reject",
                 "weight_gib": cap["weight_gib"], "kv_tokens": cap["kv_tokens"],
                 "kv_tokens_ratio": cap["kv_tokens_ratio"], "seconds": round(time.time() - t, 2)})
  result = {"budget": budget["budget"], "budget_path": os.path.abspath(budget_path), "confidence":
            cfg.admit.confidence, "memory_gib": cfg.admit.memory_gib, "setup_s": round(setup_s, 2), "candidates": rows}
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    reporting.write_csv(os.path.join(out_dir, "admission.csv"), rows)
    reporting.write_text(os.path.join(out_dir, "admission.md"), reporting.markdown_table(rows) + "\n")
    plot_budget(budget, os.path.join(out_dir, "admission.png"), rows)
    reporting.write_json(os.path.join(out_dir, "admission.json"), result)
  return result


def report(result: dict) -> str:
  if "candidates" in result:
    cols = ["name", "view", "mismatch", "ci_low", "ci_high", "verdict", "kv_tokens_ratio", "weight_gib", "seconds"]
    head = (f"budget {result['budget']:.4g} (exact KL per token); accept when the {100 * result['confidence']:.0f}%"
            f" upper bound is within it; KV capacity at {result['memory_gib']} GiB")
    return head + "\n\n" + reporting.markdown_table(result["candidates"], cols)
  fit, ci = result["fit"], lambda p: " ({:.2g}-{:.2g})".format(*p["mismatch_ci"]) * (p["mismatch_ci"][1] > 0)
  rows = [{"view": p["view"], "mismatch (95% CI)": f"{p['mismatch']:.4g}{ci(p)}",
           **{m: f"{np.median(p[m]):.4f} (seeds {', '.join(f'{x:.3f}' for x in p[m])})" for m in fit["metrics"]},
           **{f"loss_{m}": p["quality_loss"][m] for m in fit["metrics"]}, "pass": p["pass"]} for p in result["points"]]
  set_by = fit.get("tolerance_set_by", {})  # budgets of before the power rule's record have none
  tol = ", ".join(f"{m} {v:.4g}" + (f" (set by the {set_by[m]}: spread {fit['tolerance_spread'][m]:.4g}, floor "
                                    f"{fit['tolerance_floor'][m]:.4g})" if m in set_by else "")
                  for m, v in fit["tolerance"].items())
  notes = "".join(f"\ncaveat: {c}" for c in result.get("caveats", []))  # budgets of before caveats have none
  side = result.get("bracket")
  bracketed = (f"\nbracket: {side['statement']} ({side['reason']}; {len(side['steps'])} steps)" if side else "")
  return (reporting.markdown_table(rows) + f"\n\ntolerance: {tol}\nbudget: {result['budget']:.4g}"
          f" (exact KL per token; monotone: {fit['monotone']})" + bracketed + notes)
