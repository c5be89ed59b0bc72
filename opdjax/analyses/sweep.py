"""Many short training runs from one start, at different engine views: calibration, validation, OPD vs GRPO.

Every run is `opdjax.pipeline.loop.run_loop` on one `Session`, the loop `opdjax train` runs: the
session loads the task and models once and compiles each function once (the train step per
algorithm, the decode loop per engine-view model, the held-out evaluation, the weight
perturbations with sigma traced). Every run starts from the same student params; the run seed
picks the training prompts, the sampling stream and the noise by opdjax.seeds' one rule, so the run
with seed s is the `opdjax train` run with `seed=s`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from opdjax.config.schema import Config
from opdjax.pipeline import hooks as H
from opdjax.pipeline.loop import run_loop
from opdjax.pipeline.session import Session
from opdjax.views.view import EngineView


def sweep_config(cfg: Config, steps: int, eval_every: int) -> Config:
  """The config of a sweep's runs: `steps` steps (the learning-rate schedule spans them), held-out
  evaluation every `eval_every` steps."""
  return cfg.replace(train={"steps": steps, "eval_every": eval_every}, optim={"total_steps": steps})


def train_run(session: Session, view: EngineView, seed: int, algo: str = "opd", desc: str = "") -> list[dict]:
  """One run of the session's config at `view` with `seed`: a record per step (held-out quality at
  every train.eval_every steps and at the end). A run that train.on_nonfinite=halt stops ends with
  a record marked `halted` (and infinite reverse KL, zero accuracy), so it fails any quality test."""
  hooks = [H.EvalHook(session.cfg.train.eval_every), H.NonFiniteHook(session.cfg.train.on_nonfinite),
           H.Progress(desc or f"{algo} {view} seed {seed}", session.progress)]
  try:
    return run_loop(session, view=view, seed=seed, algo=algo, hooks=hooks).records
  except H.NonFiniteHalt as e:
    return [*e.records, {"step": e.records[-1]["step"], "halted": True, "reverse_kl": float("inf"), "accuracy": 0.0}]


def final_quality(records: list[dict]) -> dict[str, float]:
  last = records[-1]
  return {k: last[k] for k in ("reverse_kl", "accuracy") if k in last}


@dataclasses.dataclass(frozen=True)
class Stability:
  """How a run behaved: collapse (held-out accuracy ends far below its best, or a non-finite
  step) and grad-norm spikes (steps whose norm exceeds `spike_factor` x the running median)."""

  collapsed: bool
  nonfinite_steps: int
  grad_norm_spikes: int
  max_grad_norm: float
  best_accuracy: float | None
  final_accuracy: float | None


def stability(records: list[dict], spike_factor: float = 5.0, collapse_fraction: float = 0.5) -> Stability:
  steps = [r for r in records if "grad_norm" in r]
  norms = np.asarray([r["grad_norm"] for r in steps], np.float64)
  nonfinite = int(sum(1 for r in steps if r.get("skipped", 0.0) > 0 or not np.isfinite(r["grad_norm"])))
  spikes = 0
  for i in range(5, len(norms)):
    if np.isfinite(norms[i]) and norms[i] > spike_factor * np.median(norms[max(0, i - 20):i]):
      spikes += 1
  accs = [r["accuracy"] for r in records if "accuracy" in r]
  best = max(accs) if accs else None
  final = accs[-1] if accs else None
  halted = any(r.get("halted") for r in records)
  collapsed = nonfinite > 0 or halted or (best is not None and best > 0.1 and final < collapse_fraction * best)
  finite = norms[np.isfinite(norms)]
  return Stability(collapsed, nonfinite, spikes, float(finite.max()) if finite.size else float("nan"), best, final)
