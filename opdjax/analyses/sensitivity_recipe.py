"""`opdjax sensitivity`'s recipe selection, pure functions of the measured KLs: the layer ranking,
the smallest k of bf16 layers meeting the target, common practice's edge layers, the recipe rows
and their `EngineView` spec, and rank agreement (Spearman). The sweep that measures the KLs is
`opdjax.analyses.sensitivity`; `docs/sensitivity.md` describes the method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def rank(kls: Sequence[float]) -> list[int]:
  """Indices by decreasing KL (ties: lower index first)."""
  return sorted(range(len(kls)), key=lambda i: (-kls[i], i))


def edge_layers(num_layers: int, k: int) -> list[int]:
  """Common practice's choice of k bf16 layers: the first ceil(k/2) and the last floor(k/2)."""
  first = list(range((k + 1) // 2))
  return sorted(set(first) | set(range(num_layers - k // 2, num_layers)))


def select_bf16_layers(order: Sequence[int], measure: Callable[[list[int]], float], target: float
                       ) -> tuple[int, dict[int, float], bool]:
  """The smallest k whose measured KL with `order[:k]` in bf16 is <= target: (k, {k: KL}, met).
  Each candidate is measured (interactions between layers are real); when none meets the target,
  k = len(order) (every layer in bf16) and met = False."""
  curve = {}
  for k in range(len(order) + 1):
    curve[k] = measure(sorted(order[:k]))
    if curve[k] <= target:
      return k, curve, True
  return len(order), curve, False


def recipe_rows(bf16_layers: Sequence[int], fmt: str, has_lm_head: bool) -> list[tuple[str, str]]:
  """(pattern, format) rows, first match wins: embeddings, lm_head and the chosen layers in bf16."""
  rows = [("embed_tokens", "bf16")] + ([("lm_head", "bf16")] if has_lm_head else [])
  return rows + [(f"layers.{i}.*", "bf16") for i in sorted(bf16_layers)] + [("*", fmt)]


def recipe_spec(rows: Sequence[tuple[str, str]]) -> str:
  """The `EngineView` weights string `pattern>format|...` (no commas: view specs split on them)."""
  return "|".join(f"{p}>{f}" for p, f in rows)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
  """Spearman rank correlation (average ranks for ties); None when either side is constant."""

  def ranks(x):
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):  # average ranks for ties
      r[x == v] = r[x == v].mean()
    return r

  ra, rb = ranks(a), ranks(b)
  if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
    return None
  return float(np.corrcoef(ra, rb)[0, 1])
