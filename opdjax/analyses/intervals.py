"""The 95% Student-t intervals every verdict uses (opdjax.analyses.verdicts): of one mean, and Welch's of a
difference of two means. Wide at the few seeds a CPU run affords: that is what the data say."""

from __future__ import annotations

import math

import numpy as np

CONFIDENCE = 0.95


def interval(values, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
  """(mean, low, high): Student-t interval of the mean; (x, -inf, inf) from a single value."""
  x = np.asarray(values, np.float64)
  m = float(x.mean())
  if x.size < 2:
    return m, -math.inf, math.inf
  half = float(_t_ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
  return m, m - half, m + half


def welch_half_width(a, b, confidence: float = CONFIDENCE) -> float:
  """Half-width of the Welch interval of mean(a) - mean(b); inf with fewer than 2 values a side."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.size < 2 or b.size < 2:
    return math.inf
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  se2 = va + vb
  if se2 == 0:
    return 0.0
  df = se2 ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
  return float(_t_ppf(0.5 + confidence / 2, df) * math.sqrt(se2))


def _t_ppf(q: float, df: float) -> float:
  """Student's t quantile (scipy, imported here: `opdjax calibrate` and `admit` import this module for
  QUALITY and clean_gain, which need no scipy)."""
  from scipy import stats

  return float(stats.t.ppf(q, df))
