"""The mismatch budget file (budget.json): its format, reading it, and the fingerprint that ties a
budget to the student it was calibrated on. `opdjax calibrate` writes it (opdjax.analyses.admission);
`opdjax admit` and the run's guard (opdjax.pipeline.guard) read it."""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

from opdjax.errors import UserError

BUDGET_FORMAT = 1


def params_fingerprint(params) -> str:
  h = hashlib.sha256()
  for x in jax.tree.leaves(params):
    h.update(np.asarray(x, np.float32).tobytes())
  return h.hexdigest()[:16]


def load_budget(path: str) -> dict:
  if not os.path.exists(path):
    raise UserError(f"budget file {path} does not exist; write one with `opdjax calibrate --out DIR`.")
  try:
    with open(path) as f:
      budget = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON ({e}); re-run `opdjax calibrate`.") from None
  if budget.get("format") != BUDGET_FORMAT or "budget" not in budget:
    raise UserError(f"{path} is not a budget.json of this opdjax (format {BUDGET_FORMAT}); re-run `opdjax calibrate`.")
  return budget
