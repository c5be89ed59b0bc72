"""`opdjax mismatch`: every mismatch metric for each engine view, plus attribution.

A few OPD steps first fill a buffer of params versions (so `lag=k` has real k-step-old params),
then each view generates rollouts on the held-out prompts with the same RNG stream, the trainer
re-scores the same tokens with its current params, and the table reports every metric of
`opdjax.mismatch`. Views combining several perturbations are decomposed: the exact KL of the
combined view on its own tokens, the exact KL of each single perturbation on those same tokens,
and the interaction remainder.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from opdjax.analyses import reporting
from opdjax.config.schema import Config
from opdjax.errors import UserError
from opdjax.pipeline import hooks as H
from opdjax.pipeline.loop import run_loop
from opdjax.pipeline.session import Session
from opdjax.progress import bar as progress_bar
from opdjax.scoring.mismatch import exact_kl, sampled_metrics
from opdjax.scoring.rescore import batch_from_rollout, masked_mean, token_logprobs
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView

COLUMNS = ("exact_kl", "kl_k3_tok", "kl_k1_tok", "kl_k3_seq", "abs_r_mean", "abs_r_max", "prob_err_mult",
           "chi2_tok", "chi2_seq", "ess_tok", "ess_seq", "prob_corr")


class Measurer:
  """Rollouts from engine views and their mismatch against one trainer; the session's engines (one
  per engine-view model) and one compiled exact-KL per view model."""

  def __init__(self, session: Session):
    self.session, self.student, self.sampling = session, session.student, session.sampling
    self._kl: dict = {}
    temp = self.sampling.temperature if self.sampling.temperature > 0 else 1.0
    self._rescore = jax.jit(lambda p, b: token_logprobs(self.student, p, b, temperature=temp))

  def _for_model(self, view: EngineView):
    vmodel = view.model(self.student)
    if vmodel.cfg not in self._kl:
      self._kl[vmodel.cfg] = jax.jit(lambda vp, tp, b: exact_kl(vmodel, vp, self.student, tp, b, self.sampling))
    return self._kl[vmodel.cfg], self.session.engines.get(view)

  def view_params(self, view: EngineView, history: ParamsHistory, seed: int = 0):
    version, lagged = history.lagged(view.lag)
    return self.session.views(view, lagged, version, seed)

  def _rollout_batch(self, view: EngineView, history: ParamsHistory, prompts, seed: int):
    kl_fn, engine = self._for_model(view)
    vparams = self.view_params(view, history, seed)
    engine.sync(vparams, history.lagged(view.lag)[0])
    return kl_fn, vparams, batch_from_rollout(engine.generate(prompts, self.sampling, seed=seed))

  def measure(self, view: EngineView, history: ParamsHistory, trainer_params, prompts, seed: int):
    kl_fn, vparams, batch = self._rollout_batch(view, history, prompts, seed)
    trainer_lp = self._rescore(trainer_params, batch)
    metrics = sampled_metrics(batch["rollout_logprobs"], trainer_lp, batch["loss_mask"])
    metrics["exact_kl"] = masked_mean(kl_fn(vparams, trainer_params, batch), batch["loss_mask"])
    return {k: float(v) for k, v in metrics.items()}, batch

  def compiled(self) -> dict[str, int]:
    return {f"measure_{k}": v for k, v in self.session.views.compiled().items()}

  def exact_kl_tokens(self, view: EngineView, history: ParamsHistory, trainer_params, prompts, seed: int):
    """Per-position exact KL `[B, L]` of the view's own rollout and its loss mask (for intervals)."""
    kl_fn, vparams, batch = self._rollout_batch(view, history, prompts, seed)
    return np.asarray(kl_fn(vparams, trainer_params, batch)), np.asarray(batch["loss_mask"])

  def attribute(self, view: EngineView, history: ParamsHistory, trainer_params, batch, total: float, seed: int = 0):
    """Exact KL of each single perturbation on the combined view's tokens, and the remainder."""
    rows = {}
    for name, single in view.sources().items():
      kl_fn, _ = self._for_model(single)
      kl = kl_fn(self.view_params(single, history, seed), trainer_params, batch)
      rows[name] = float(masked_mean(kl, batch["loss_mask"]))
    rows["interaction"] = total - sum(rows.values())
    return rows


def warmup_history(session: Session, steps: int, max_lag: int):
  """`steps` clean OPD steps of the session's run from the start (the loop `opdjax train` runs):
  (state, history of the last max_lag + 1 params versions). Real optimizer steps, so that lagged
  params differ the way they do in training."""
  keep = H.HistoryHook(max_lag + 1)
  loop = run_loop(session, view=EngineView(), steps=steps, hooks=[keep])
  return loop.state, keep.history


def parse_views(spec: str, warmup_steps: int, section: str) -> tuple[list[EngineView], int]:
  """';'-separated engine views and their largest lag, which the warmup must cover."""
  views = [EngineView.parse(s) for s in spec.split(";")]
  max_lag = max(v.lag for v in views)
  if warmup_steps < max_lag:
    raise UserError(f"a view asks for lag {max_lag} but {section}.warmup_steps={warmup_steps};"
                    f" raise warmup_steps to at least {max_lag}.")
  return views, max_lag


def run(cfg: Config, out_dir: str | None = None, progress: bool = True) -> dict:
  views, max_lag = parse_views(cfg.mismatch.sources, cfg.mismatch.warmup_steps, "mismatch")
  session = Session(cfg, progress=progress)
  try:
    state, history = warmup_history(session, cfg.mismatch.warmup_steps, max_lag)
    measurer = Measurer(session)
    prompts = session.task.eval_set()[0][: cfg.mismatch.num_prompts]
    results = {"views": {}, "attribution": {}}
    seed = cfg.mismatch.seed
    for view in progress_bar(views, desc="views", enabled=progress):
      metrics, batch = measurer.measure(view, history, state.params, prompts, seed=seed)
      results["views"][str(view)] = metrics
      if len(view.sources()) > 1:
        results["attribution"][str(view)] = {
            "total": metrics["exact_kl"],
            **measurer.attribute(view, history, state.params, batch, metrics["exact_kl"], seed)}
  finally:
    session.close()
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    reporting.write_json(os.path.join(out_dir, "mismatch.json"), results)
  return results


def format_tables(results: dict) -> str:
  names = list(results["views"])
  width = max(len(n) for n in names) + 2
  lines = ["view".ljust(width) + "".join(c.rjust(14) for c in COLUMNS)]
  for n in names:
    m = results["views"][n]
    lines.append(n.ljust(width) + "".join(f"{m[c]:14.4g}" for c in COLUMNS))
  for n, rows in results["attribution"].items():
    lines += ["", f"attribution of exact KL for {n}:"]
    lines += [f"  {k:<12}{v:12.4g}  ({100 * v / max(rows['total'], 1e-30):5.1f}%)" for k, v in rows.items()]
  return "\n".join(lines)
