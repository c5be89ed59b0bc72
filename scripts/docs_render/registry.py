"""Every figure by NAME (docs/results/NAME.json): the union of the page modules' FIGURES."""

from __future__ import annotations

from .common import Figure
from .pages import (
  admission,
  asynchronous,
  benchmarks,
  kv_capacity,
  mismatch,
  pair,
  prefix_shift,
  readme,
  reproduction,
  scaling,
  sensitivity,
  served_teacher,
)

PAGES = (readme, benchmarks, asynchronous, admission, kv_capacity, mismatch, pair, prefix_shift, reproduction, scaling,
         sensitivity, served_teacher)
FIGURES: dict[str, Figure] = {}
for page in PAGES:
  assert not FIGURES.keys() & page.FIGURES.keys(), f"{page.__name__} names a figure another page does"
  FIGURES.update(page.FIGURES)
