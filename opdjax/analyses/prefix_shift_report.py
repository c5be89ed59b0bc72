"""`opdjax prefix-shift` outputs: the table, CSV/markdown/JSON files and the two plots."""

from __future__ import annotations

import math
import os

import numpy as np

from opdjax.analyses import reporting

RELATIVE = ("per_token", "prefix_shift", "tis_residual", "total_raw", "total_tis", "per_token_shared",
            "prefix_shift_shared", "clean_shared")

CSV_COLUMNS = (["view", "family", "strength", "frac_diverged", "first_div_p10", "first_div_median", "first_div_p90",
                "first_div_mean", "shared_token_frac"] + [f"grad_rel_{n}" for n in RELATIVE]
               + ["grad_cos_raw_clean", "grad_cos_tis_clean", "grad_cos_is_full_clean",
                  "grad_cos_per_token_prefix_shift", "value_clean", "value_raw", "value_tis", "value_is_full"]
               + [f"value_rel_{n}" for n in RELATIVE])


def _rows(results: dict) -> list[dict]:
  rows = []
  for r in [*(results[f] for f in ("floor_same_seed", "noise_floor") if f in results), *results["views"].values()]:
    row = {"view": r["view"], "family": r["family"], "strength": r["strength"]}
    row.update({k: v for k, v in r["divergence"].items() if k not in ("first_div_hist", "num_sequences")})
    row.update({f"grad_{k}": v for k, v in r["grad"].items() if k != "clean_norm"})
    row.update({f"value_{k}": v for k, v in r["value"].items()})
    rows.append(row)
  return rows


def _fmt(v):
  if v is None:
    return "-"
  return round(v, 4) if isinstance(v, float) else v


def summary_table(results: dict) -> str:
  cols = ("view", "frac_diverged", "first_div_median", "shared_token_frac", "grad_rel_per_token",
          "grad_rel_prefix_shift", "grad_rel_tis_residual", "grad_rel_prefix_shift_shared",
          "value_rel_per_token", "value_rel_prefix_shift")
  rows = [{c: _fmt(r.get(c)) for c in cols} for r in _rows(results)]
  return reporting.markdown_table(rows, cols)


def report(results: dict) -> str:
  c = results["config"]
  head = (f"prefix shift: {c['num_prompts']} prompts, {c['clean_tokens']} clean completion tokens, seed {c['seed']},"
          f" TIS C={c['is_threshold']}; clean |G|={results['clean']['grad_norm']:.4g},"
          f" KL(p||t)={results['clean']['reverse_kl']:.4g}.\n"
          "grad_rel_* = ||error|| / ||G_clean||; per_token = raw - is_full (fixed by importance weights),"
          " prefix_shift = is_full - clean (not), *_shared: positions before the first divergence.\n")
  return head + summary_table(results)


def write_outputs(results: dict, out_dir: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  reporting.write_json(os.path.join(out_dir, "prefix_shift.json"), results)
  reporting.write_csv(os.path.join(out_dir, "prefix_shift.csv"), _rows(results), CSV_COLUMNS)
  reporting.write_text(os.path.join(out_dir, "prefix_shift.md"),
                       "# Prefix shift\n\n" + report(results) + "\n\n![divergence](divergence.png)\n\n"
                       "![signal error](signal_error.png)\n")
  plot_divergence(results, os.path.join(out_dir, "divergence.png"))
  plot_signal_error(results, os.path.join(out_dir, "signal_error.png"))


def _by_family(results: dict) -> dict[str, list[dict]]:
  out = {"noise": [], "lag": [], "other": []}
  for r in results["views"].values():
    out[r["family"]].append(r)
  for fam in ("noise", "lag"):
    out[fam].sort(key=lambda r: r["strength"])
  return out


_XLABEL = {"noise": "noise sigma (x RMS of each matrix)", "lag": "lag k (optimizer steps)", "other": ""}


def _panels(results: dict):
  fams = [f for f, rows in _by_family(results).items() if rows]
  return fams, _by_family(results)


def _axis(ax, fam, rows, ys: dict[str, list], floor: dict[str, float] | None = None, ylabel: str = ""):
  """One family: lines against strength (noise, lag), or grouped bars per view (other)."""
  if fam == "other":
    x = np.arange(len(rows))
    width = 0.8 / max(len(ys), 1)
    for i, (label, y) in enumerate(ys.items()):
      ax.bar(x + (i - (len(ys) - 1) / 2) * width, [np.nan if v is None else v for v in y], width, label=label)
    ax.set_xticks(x, [r["view"].replace(",", "\n") for r in rows], fontsize=7)
  else:
    xs = [r["strength"] for r in rows]
    for label, y in ys.items():
      ax.plot(xs, [np.nan if v is None else v for v in y], "o-", label=label)
    ax.set_xscale("log", base=10 if fam == "noise" else 2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(_XLABEL[fam])
  for label, v in (floor or {}).items():
    if v is not None and math.isfinite(v):
      ax.axhline(v, ls="--", lw=1, color="gray", label=label)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)


def plot_divergence(results: dict, path: str) -> str:
  fams, by = _panels(results)
  fig, axes = reporting.figure(2, len(fams), figsize=(4.2 * len(fams), 6), squeeze=False)
  floor = results["noise_floor"]["divergence"]
  for col, fam in enumerate(fams):
    rows = by[fam]
    _axis(axes[0, col], fam, rows, {"fraction diverged": [r["divergence"]["frac_diverged"] for r in rows]},
          {"other seed": floor["frac_diverged"]}, "fraction of sequences diverged")
    _axis(axes[1, col], fam, rows,
          {"median": [r["divergence"]["first_div_median"] for r in rows],
           "p10": [r["divergence"]["first_div_p10"] for r in rows],
           "p90": [r["divergence"]["first_div_p90"] for r in rows]},
          {"other seed (median)": floor["first_div_median"]}, "first divergence (completion index)")
    axes[0, col].set_title({"noise": "weight noise", "lag": "stale params", "other": "quantized weights / other"}[fam])
    axes[0, col].set_ylim(-0.03, 1.03)
  axes[0, 0].legend(fontsize=7)
  axes[1, 0].legend(fontsize=7)
  return reporting.save_figure(fig, path)


def plot_signal_error(results: dict, path: str) -> str:
  fams, by = _panels(results)
  fig, axes = reporting.figure(2, len(fams), figsize=(4.2 * len(fams), 6), squeeze=False)
  floor = results["noise_floor"]
  for col, fam in enumerate(fams):
    rows = by[fam]
    _axis(axes[0, col], fam, rows,
          {"(i) per-token": [r["grad"]["rel_per_token"] for r in rows],
           "(ii) prefix shift": [r["grad"]["rel_prefix_shift"] for r in rows],
           "TIS residual": [r["grad"]["rel_tis_residual"] for r in rows]},
          {"(ii) other seed": floor["grad"]["rel_prefix_shift"]}, "||grad error|| / ||G_clean||")
    _axis(axes[1, col], fam, rows,
          {"(i) per-token": [abs(r["value"]["rel_per_token"]) for r in rows],
           "(ii) prefix shift": [abs(r["value"]["rel_prefix_shift"]) for r in rows],
           "TIS residual": [abs(r["value"]["rel_tis_residual"]) for r in rows]},
          {"(ii) other seed": abs(floor["value"]["rel_prefix_shift"])}, "|loss error| / KL(p||t) clean")
    axes[0, col].set_title({"noise": "weight noise", "lag": "stale params", "other": "quantized weights / other"}[fam])
    if fam != "other":
      for ax in axes[:, col]:
        ax.set_yscale("symlog", linthresh=1e-3)  # exact zeros stay on the plot
        ax.set_ylim(bottom=0)
  axes[0, 0].legend(fontsize=7)
  return reporting.save_figure(fig, path)
