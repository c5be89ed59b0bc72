from __future__ import annotations

import json
import os
from collections.abc import Callable

from ..common import Figure, markdown_table


def collect_sensitivity(out: str) -> dict:
  """Each model's sensitivity.json (the demo teacher, SmolLM2): every number of the page and its four PNGs."""
  return {m: json.load(open(os.path.join(out, m, "sensitivity.json"))) for m in ("demo", "smollm2")}


def _short(p: str) -> str:
  return p.replace(":channel", "").replace("noise:", "noise ")


def _by_kl(entries: list[dict], key: str, p: str) -> list[tuple]:
  """(name, KL) of `entries` under perturbation p, largest first (ties: the lower name first)."""
  return sorted(((e[key], e[p]) for e in entries), key=lambda t: (-t[1], str(t[0])))


def sens_run(model: str) -> Callable[[dict], str]:
  def view(r: dict) -> str:
    s = r["result"][model]
    return (f"{s['num_sequences']} prompts, {s['num_tokens']} sampled tokens (held out: {s['heldout']['num_prompts']}"
            f" prompts, {s['heldout']['num_tokens']} tokens); {s['seconds']:.0f} s")
  return view


def sens_ranking(model: str) -> Callable[[dict], str]:
  """Per perturbation, the layers and the module kinds most sensitive first (the ten most, the least), KLs."""
  def view(r: dict) -> str:
    s = r["result"][model]
    rows = []
    for scope, key in (("layers", "layer"), ("kinds", "kind")):
      for p in s["settings"]["perturbations"]:
        order = _by_kl(s[scope], key, p)
        shown = ", ".join(f"{n} ({kl:.2g})" for n, kl in order[:10])
        if len(order) > 10:
          shown += f" ... least: {order[-1][0]} ({order[-1][1]:.2g})"
        rows.append([f"{scope}, {_short(p)}", shown])
    return markdown_table(["", "most sensitive first (exact KL per token)"], rows)
  return view


def _layers(ids: list[int]) -> str:
  return " ".join(map(str, ids)) or "-"


def sens_recipe(model: str) -> Callable[[dict], str]:
  """The recipe against the same-memory baselines, on the tokens that chose it and on held-out prompts."""
  def view(r: dict) -> str:
    s = r["result"][model]
    rec, base, held = s["recipe"], s["baselines"], s["heldout"]
    rel = lambda kl: f" ({kl / rec['measured_kl'] - 1:+.0%})"  # noqa: E731
    rows = [["sensitivity recipe", _layers(rec["bf16_layers"]),
             f"**{rec['measured_kl']:.3g}** (target {'met' if rec['target_met'] else 'missed'})",
             f"**{held['recipe_kl']:.3g}**"],
            ["edge layers", _layers(base["edge"]["bf16_layers"]), f"{base['edge']['kl']:.3g}{rel(base['edge']['kl'])}",
             f"{held['edge_kl']:.3g}"],
            [f"random (mean of {len(base['random']['kls'])})", "", f"{base['random']['kl']:.3g}"
             f"{rel(base['random']['kl'])}", f"{held['random_kl']:.3g}"],
            ["all layers quantized (k = 0) / all bf16", "", f"{rec['kl_all_quantized']:.3g} / {rec['kl_all_bf16']:.2g}",
             ""]]
    head = [f"same memory (k = {rec['k']}, {_short(rec['format'])})", "bf16 layers", "exact KL (sampled tokens)",
            "exact KL (held-out prompts)"]
    return (markdown_table(head, rows) + f"\n\nTarget {rec['target_kl']:.3g}"
            f"{' (half of k = 0)' if rec['target_auto'] else ''}; {rec['weight_mib']:.3g} MiB of weights"
            f" (all bf16: {base['all_bf16_mib']:.3g} MiB).")
  return view


def sens_curve(model: str) -> Callable[[dict], str]:
  def view(r: dict) -> str:
    c = r["result"][model]["curve"]
    return ("KL against the number k of bf16 layers (the sensitivity order / the edge order): "
            + ", ".join(f"k = {e['k']}: {e['sensitivity_kl']:.3g} / {e['edge_kl']:.3g}" for e in c) + ".")
  return view


def sens_formats(model: str) -> Callable[[dict], str]:
  """Each perturbation's layer KLs against the recipe format's: the geometric mean of their ratio over the layers."""
  def view(r: dict) -> str:
    import math

    s = r["result"][model]
    ref = s["recipe"]["format"]
    parts = []
    for p in s["settings"]["perturbations"]:
      if p != ref:
        g = math.exp(sum(math.log(e[p] / e[ref]) for e in s["layers"]) / len(s["layers"]))
        parts.append(f"{_short(p)} {g:.2g}x")
    agree = ", ".join(f"{_short(p)} {x:.2f}" for p, x in s["format_agreement"].items())
    return (f"a layer's KL against its {_short(ref)} KL (geometric mean over the layers): " + ", ".join(parts)
            + f"; Spearman of the layer KLs against {_short(ref)}'s: {agree}")
  return view


def sens_heldout(model: str) -> Callable[[dict], str]:
  """The recipe's margin over the same-memory edge layers where it was chosen and on held-out prompts, and
  whether the target still holds there."""
  def view(r: dict) -> str:
    s = r["result"][model]
    rec, base, held = s["recipe"], s["baselines"], s["heldout"]
    inside = 1 - rec["measured_kl"] / base["edge"]["kl"]
    out = 1 - held["recipe_kl"] / held["edge_kl"]
    target = "meets" if held["recipe_kl"] <= rec["target_kl"] else "misses"
    return (f"the recipe's KL is {inside:.0%} below the edge layers' on the tokens that chose it and {out:.0%} below"
            f" on {held['num_prompts']} held-out prompts ({held['num_tokens']} tokens, one sample, no interval), where"
            f" it {target} the target")
  return view


def sens_spearman(r: dict) -> str:
  """Spearman correlation of the two models' module-kind KLs over the kinds both have, per perturbation."""
  from scipy.stats import spearmanr  # imported where the view needs it (scipy: a dependency of the study's rules)

  a, b = r["result"]["demo"], r["result"]["smollm2"]
  ka, kb = ({e["kind"]: e for e in m["kinds"]} for m in (a, b))
  common = [k for k in ka if k in kb]
  points = [p for p in a["settings"]["perturbations"] if p in b["settings"]["perturbations"]]
  rhos = [spearmanr([ka[k][p] for k in common], [kb[k][p] for k in common]).statistic for p in points]
  table = markdown_table(["perturbation", *map(_short, points)],
                         [[f"Spearman over {len(common)} common kinds", *(f"{x:.2f}" for x in rhos)]])
  negative = sum(x < 0 for x in rhos)
  return table + f"\n\n{negative} of the {len(rhos)} coefficients are negative, the largest {max(rhos):.2f}."


def _sens_plot(model: str, which: str) -> Callable[[dict, str], str]:
  from opdjax.analyses import sensitivity_report

  plot = sensitivity_report.plot_sweep if which == "sweep" else sensitivity_report.plot_recipe
  return lambda result, path: plot(result[model], path)


FIGURES: dict[str, Figure] = {
    "sensitivity": Figure(("opdjax sensitivity --out {out}/demo",
                           "opdjax sensitivity --config configs/smollm2_sensitivity.py --out {out}/smollm2"),
                          collect_sensitivity,
                          {**{f"{m}_{v}": f(m) for m in ("demo", "smollm2")
                              for v, f in (("run", sens_run), ("ranking", sens_ranking), ("recipe", sens_recipe),
                                           ("curve", sens_curve), ("formats", sens_formats),
                                           ("heldout", sens_heldout))},
                           "spearman": sens_spearman},
                          images=tuple((f"docs/figures/sensitivity_{m}{tail}.png", _sens_plot(m, which))
                                       for m in ("demo", "smollm2")
                                       for tail, which in (("", "sweep"), ("_recipe", "recipe")))),
}
