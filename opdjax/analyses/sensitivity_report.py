"""`opdjax sensitivity` outputs: the markdown report, CSV/JSON files, the recipe files, the two plots
and the terminal summary."""

from __future__ import annotations

import functools
import math
import os

import numpy as np

from opdjax.analyses import reporting
from opdjax.analyses.sensitivity_recipe import rank


def _short(p: str) -> str:
  return p.replace(":channel", "")


def _label(p: str) -> str:
  return _short(p).replace("noise:", "noise ")


def _layers(ids: list[int]) -> str:
  return " ".join(map(str, ids)) or "-"


def summary(results: dict) -> str:
  """The run, the rankings (the ten most sensitive, the least), the recipe against the same-memory baselines on the
  tokens that chose it and on held-out prompts, the KL curve over k, the formats against each other: the head of
  the command's sensitivity.md and docs/sensitivity.md's section of one model."""
  s, rec, base = results, results["recipe"], results["baselines"]
  held = s["heldout"] or {"num_prompts": 0, "num_tokens": 0, **{f"{k}_kl": float("nan") for k in ("recipe", "edge",
                                                                                                  "random")}}
  ranking = []
  for scope, key in (("layers", "layer"), ("kinds", "kind")):
    for p in s["settings"]["perturbations"]:
      order = sorted(((e[key], e[p]) for e in s[scope]), key=lambda t: (-t[1], str(t[0])))
      shown = ", ".join(f"{n} ({kl:.2g})" for n, kl in order[:10])
      ranking.append([f"{scope}, {_label(p)}", shown + (f" ... least: {order[-1][0]} ({order[-1][1]:.2g})"
                                                        if len(order) > 10 else "")])
  rel = lambda kl: f" ({kl / rec['measured_kl'] - 1:+.0%})"  # noqa: E731
  recipe = [["sensitivity recipe", _layers(rec["bf16_layers"]),
             f"**{rec['measured_kl']:.3g}** (target {'met' if rec['target_met'] else 'missed'})",
             f"**{held['recipe_kl']:.3g}**"],
            ["edge layers", _layers(base["edge"]["bf16_layers"]), f"{base['edge']['kl']:.3g}{rel(base['edge']['kl'])}",
             f"{held['edge_kl']:.3g}"],
            [f"random (mean of {len(base['random']['kls'])})", "", f"{base['random']['kl']:.3g}"
             f"{rel(base['random']['kl'])}", f"{held['random_kl']:.3g}"],
            ["all layers quantized (k = 0) / all bf16", "", f"{rec['kl_all_quantized']:.3g} / {rec['kl_all_bf16']:.2g}",
             ""]]
  ref = rec["format"]
  def geo(p):  # the geometric mean over layers of p's KL over the reference format's (layers where both are > 0)
    logs = [math.log(e[p] / e[ref]) for e in s["layers"] if e[p] > 0 and e[ref] > 0]
    return f"{math.exp(sum(logs) / len(logs)):.2g}x" if logs else "n/a (no layer with both KLs > 0)"

  ratios = ", ".join(f"{_label(p)} {geo(p)}" for p in s["settings"]["perturbations"] if p != ref)
  agree = ", ".join(f"{_label(p)} {x:.2f}" for p, x in s["format_agreement"].items())
  inside = 1 - rec["measured_kl"] / base["edge"]["kl"]
  out = (f" and {1 - held['recipe_kl'] / held['edge_kl']:.0%} below on {held['num_prompts']} held-out prompts"
         f" ({held['num_tokens']} tokens, one sample, no interval), where it"
         f" {'meets' if held['recipe_kl'] <= rec['target_kl'] else 'misses'} the target" if s["heldout"] else
         " (no held-out prompts)")
  return "\n\n".join([
      f"The run: {s['num_sequences']} prompts, {s['num_tokens']} sampled tokens (held out: {held['num_prompts']}"
      f" prompts, {held['num_tokens']} tokens); {s['seconds']:.0f} s.",
      reporting.markdown_table(ranking, ["", "most sensitive first (exact KL per token)"]),
      reporting.markdown_table(recipe, [f"same memory (k = {rec['k']}, {_label(ref)})", "bf16 layers",
                                        "exact KL (sampled tokens)", "exact KL (held-out prompts)"]),
      f"Target {rec['target_kl']:.3g}{' (half of k = 0)' if rec['target_auto'] else ''}; {rec['weight_mib']:.3g} MiB"
      f" of weights (all bf16: {base['all_bf16_mib']:.3g} MiB). Out of sample: the recipe's KL is {inside:.0%} below"
      f" the edge layers' on the tokens that chose it{out}.",
      "KL against the number k of bf16 layers (the sensitivity order / the edge order): "
      + ", ".join(f"k = {e['k']}: {e['sensitivity_kl']:.3g} / {e['edge_kl']:.3g}" for e in s["curve"]) + ".",
      f"Formats: a layer's KL against its {_label(ref)} KL (geometric mean over the layers): {ratios}; Spearman of"
      f" the layer KLs against {_label(ref)}'s: {agree}."])


def tables(results: dict) -> str:
  """The markdown report: the summary, then per-layer and per-kind KLs and the recipe's engine view."""
  points = results["settings"]["perturbations"]
  fmt = results["recipe"]["format"]
  pos = {i: r for r, i in enumerate(results["ranking"]["layers"])}
  layer_rows = [{"layer": r["layer"], **{_short(p): r[p] for p in points},
                 f"rank ({_short(fmt)})": pos[r["layer"]] + 1} for r in results["layers"]]
  kind_pos = {k: r for r, k in enumerate(results["ranking"]["kinds"])}
  kind_rows = [{"kind": r["kind"], **{_short(p): r[p] for p in points},
                f"rank ({_short(fmt)})": kind_pos[r["kind"]] + 1} for r in results["kinds"]]
  m = results["model"]
  return "\n\n".join([
      f"# Layer sensitivity: {m.get('path', '')} ({m['model_type']}, {m['num_layers']} layers)",
      f"Exact KL(perturbed || clean) per completion token, {results['num_tokens']} tokens of"
      f" {results['num_sequences']} sequences sampled by the clean model; clean floor {results['kl_clean']:.3g}.",
      summary(results),
      "## Per layer (all matrices of one layer)", reporting.markdown_table(layer_rows),
      "## Per module kind (that projection in every layer)", reporting.markdown_table(kind_rows),
      f"Engine view of the recipe:\n\n    {results['recipe']['engine_view']}",
  ]) + "\n"


def plot_sweep(results: dict, path: str) -> str:
  points = results["settings"]["perturbations"]
  n = results["model"]["num_layers"]
  fig, axes = reporting.figure(len(points), 2, figsize=(10, 1.6 + 1.4 * len(points)), squeeze=False,
                               gridspec_kw={"width_ratios": [max(n, 4), len(results["kinds"])]})
  kinds = [r["kind"] for r in results["kinds"]]
  for row, p in enumerate(points):
    a, b = axes[row]
    a.bar(range(n), [r[p] for r in results["layers"]], color=f"C{row}")
    a.set_ylabel(f"KL, {_short(p)}", fontsize=8)
    b.bar(range(len(kinds)), [r[p] for r in results["kinds"]], color=f"C{row}")
    for ax in (a, b):
      ax.tick_params(labelsize=7)
      ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    a.set_xticks(range(n) if n <= 32 else range(0, n, 4))
    b.set_xticks(range(len(kinds)))
    b.set_xticklabels(kinds if row == len(points) - 1 else [], rotation=60, ha="right", fontsize=7)
  axes[-1][0].set_xlabel("layer (one layer perturbed)")
  axes[0][0].set_title("one layer perturbed", fontsize=9)
  axes[0][1].set_title("one module kind perturbed (all layers)", fontsize=9)
  fig.suptitle(f"{results['model'].get('path', '')}: exact KL(perturbed || clean)", fontsize=10)
  return reporting.save_figure(fig, path)


def plot_recipe(results: dict, path: str) -> str:
  from matplotlib.ticker import MaxNLocator

  rec, base, curve = results["recipe"], results["baselines"], results["curve"]
  fig, ax = reporting.figure(figsize=(6, 3.4))
  ks = [r["k"] for r in curve]
  ax.plot(ks, [r["sensitivity_kl"] for r in curve], "o-", ms=3, label="most sensitive layers in bf16")
  ax.plot(ks, [r["edge_kl"] for r in curve], "s--", ms=3, label="edge layers in bf16 (common practice)")
  kls = base["random"]["kls"]
  ax.errorbar([rec["k"]], [np.mean(kls)], yerr=[[np.mean(kls) - min(kls)], [max(kls) - np.mean(kls)]], fmt="^",
              color="C2", label=f"random {rec['k']} layers (mean, range)")
  ax.axhline(rec["target_kl"], color="gray", lw=0.8, ls=":", label="target")
  ax.axvline(rec["k"], color="gray", lw=0.5)
  ax.set_yscale("log")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel(f"k layers kept in bf16 (the rest {_short(rec['format'])})")
  ax.set_ylabel("exact KL")
  ax.set_title(f"{results['model'].get('path', '')}: recipe KL vs memory", fontsize=9)
  ax.legend(fontsize=7)
  return reporting.save_figure(fig, path)


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """sensitivity.{json,csv,md}, recipe_curve.csv, recipe.json, recipe_view.txt and two PNGs."""
  j = functools.partial(os.path.join, out_dir)
  rows = []
  for scope, key, entries in (("layer", "layer", results["layers"]), ("kind", "kind", results["kinds"])):
    for p in results["settings"]["perturbations"]:
      order = rank([r[p] for r in entries])
      pos = {i: r for r, i in enumerate(order)}
      rows += [{"scope": scope, "name": r[key], "perturbation": p, "exact_kl": r[p], "rank": pos[i] + 1}
               for i, r in enumerate(entries)]
  rec = results["recipe"]
  recipe = {**{k: rec[k] for k in ("engine_view", "weights", "target_kl", "measured_kl", "target_met", "bf16_layers",
                                   "format", "k", "weight_mib")},
            "recipe": rec["rows"], "model": results["model"],
            "same_memory": {"edge_kl": results["baselines"]["edge"]["kl"],
                            "random_kl": results["baselines"]["random"]["kl"]}}
  files = [
      reporting.write_json(j("sensitivity.json"), {k: v for k, v in results.items() if k != "files"}),
      reporting.write_csv(j("sensitivity.csv"), rows),
      reporting.write_csv(j("recipe_curve.csv"), results["curve"]),
      reporting.write_text(j("sensitivity.md"), tables(results)),
      reporting.write_json(j("recipe.json"), recipe),
      reporting.write_text(j("recipe_view.txt"), rec["engine_view"] + "\n"),
      plot_sweep(results, j("sensitivity.png")),
      plot_recipe(results, j("sensitivity_recipe.png")),
  ]
  return files


def report(results: dict) -> str:
  """A few lines for the terminal: the rankings and the recipe against its same-memory baselines."""
  rec, base = results["recipe"], results["baselines"]
  fmt = _short(rec["format"])
  by_layer = {r["layer"]: r for r in results["layers"]}
  top = ", ".join(f"{i} ({by_layer[i][rec['format']]:.3g})" for i in results["ranking"]["layers"][:5])
  lines = [
      f"sensitivity of the {results['model'].get('role', 'model')} ({results['model']['model_type']},"
      f" {results['model']['num_layers']} layers) on {results['num_tokens']} sampled tokens:",
      f"  most sensitive layers under {fmt}: {top}",
      f"  module kinds, most sensitive first: {', '.join(results['ranking']['kinds'])}",
      f"  recipe: {rec['k']} layer(s) in bf16 {rec['bf16_layers']} -> exact KL {rec['measured_kl']:.4g}"
      f" (target {rec['target_kl']:.4g}, {'met' if rec['target_met'] else 'NOT met'}; all quantized"
      f" {rec['kl_all_quantized']:.4g})",
      f"  same memory: edge layers {base['edge']['bf16_layers']} {base['edge']['kl']:.4g}, random"
      f" {base['random']['kl']:.4g} (mean of {len(base['random']['kls'])})",
      f"  engine view: {rec['engine_view']}",
  ]
  if results.get("files"):
    lines.append(f"  wrote {', '.join(os.path.basename(f) for f in results['files'])} to"
                 f" {os.path.dirname(results['files'][0])}")
  return "\n".join(lines)
