"""`opdjax mismatch`: every mismatch metric for each engine view, plus attribution.

A few OPD steps first fill a buffer of params versions (so `lag=k` has real k-step-old params),
then each view generates rollouts on the held-out prompts with the same RNG stream, the trainer
re-scores the same tokens with its current params, and the table reports every metric of
`opdjax.mismatch`. Views combining several perturbations are decomposed: the exact KL of the
combined view on its own tokens, the exact KL of each single perturbation on those same tokens,
and the interaction remainder.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from opdjax.errors import UserError
from opdjax.pipeline.build import load_model, make_task
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.scoring.mismatch import exact_kl, sampled_metrics
from opdjax.scoring.rescore import batch_from_rollout, masked_mean, token_logprobs
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig, TrainState, make_optimizer, make_train_step
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView, ViewTransform

COLUMNS = ("exact_kl", "kl_k3_tok", "kl_k1_tok", "kl_k3_seq", "abs_r_mean", "abs_r_max", "prob_err_mult",
           "chi2_tok", "chi2_seq", "ess_tok", "ess_seq", "prob_corr")


class Measurer:
  """Rollouts from engine views and their mismatch against one trainer; compiled once per view model."""

  def __init__(self, student, task, sampling: SamplingParams, max_len: int):
    self.student, self.task, self.sampling, self.max_len = student, task, sampling, max_len
    self._fns: dict = {}
    self._views = ViewTransform(student.cfg.num_layers)
    temp = sampling.temperature if sampling.temperature > 0 else 1.0
    self._rescore = jax.jit(lambda p, b: token_logprobs(student, p, b, temperature=temp))

  def _for_model(self, view: EngineView):
    vmodel = view.model(self.student)
    if vmodel.cfg not in self._fns:
      kl = jax.jit(lambda vp, tp, b: exact_kl(vmodel, vp, self.student, tp, b, self.sampling))
      engine = JaxEngine(vmodel, None, max_len=self.max_len, pad_id=self.task.pad_id, eos_ids=self.task.eos_ids)
      self._fns[vmodel.cfg] = (vmodel, kl, engine)
    return self._fns[vmodel.cfg]

  def view_params(self, view: EngineView, history: ParamsHistory, noise_step: int = 0):
    _, lagged = history.lagged(view.lag)
    return self._views(view, lagged, jax.random.fold_in(jax.random.key(view.noise_seed), noise_step))

  def measure(self, view: EngineView, history: ParamsHistory, trainer_params, prompts, seed: int):
    _, kl_fn, engine = self._for_model(view)
    vparams = self.view_params(view, history)
    engine.sync(vparams, history.lagged(view.lag)[0])
    rollout = engine.generate(prompts, self.sampling, seed=seed)
    batch = batch_from_rollout(rollout)
    trainer_lp = self._rescore(trainer_params, batch)
    metrics = sampled_metrics(batch["rollout_logprobs"], trainer_lp, batch["loss_mask"])
    metrics["exact_kl"] = masked_mean(kl_fn(vparams, trainer_params, batch), batch["loss_mask"])
    return {k: float(v) for k, v in metrics.items()}, batch

  def compiled(self) -> dict[str, int]:
    return {f"measure_{k}": v for k, v in self._views.compiled().items()}

  def exact_kl_tokens(self, view: EngineView, history: ParamsHistory, trainer_params, prompts, seed: int):
    """Per-position exact KL `[B, L]` of the view's own rollout and its loss mask (for intervals)."""
    _, kl_fn, engine = self._for_model(view)
    vparams = self.view_params(view, history)
    engine.sync(vparams, history.lagged(view.lag)[0])
    batch = batch_from_rollout(engine.generate(prompts, self.sampling, seed=seed))
    return np.asarray(kl_fn(vparams, trainer_params, batch)), np.asarray(batch["loss_mask"])

  def attribute(self, view: EngineView, history: ParamsHistory, trainer_params, batch, total: float):
    """Exact KL of each single perturbation on the combined view's tokens, and the remainder."""
    rows = {}
    for name, single in view.sources().items():
      _, kl_fn, _ = self._for_model(single)
      kl = kl_fn(self.view_params(single, history), trainer_params, batch)
      rows[name] = float(masked_mean(kl, batch["loss_mask"]))
    rows["interaction"] = total - sum(rows.values())
    return rows


def sampling_params(cfg: ml_collections.ConfigDict) -> SamplingParams:
  return SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)


def warmup_history(cfg, task, student, student_params, teacher, teacher_params, steps: int, max_lag: int):
  """`steps` clean OPD steps from the start: (state, history of the last max_lag + 1 versions).

  Real optimizer steps, so that lagged params differ the way they do in training.
  """
  optimizer = make_optimizer(OptimConfig(**cfg.optim))
  step_fn = make_train_step(student, teacher, LossConfig(**cfg.loss), optimizer)
  state = TrainState.create(jax.tree.map(jnp.copy, student_params), optimizer)  # the step donates it
  history = ParamsHistory(max_lag + 1)
  history.push(0, state.params)
  engine = JaxEngine(student, state.params, max_len=cfg.rollout.max_len, pad_id=task.pad_id, eos_ids=task.eos_ids)
  rng = np.random.default_rng(cfg.seed)
  sampling = sampling_params(cfg)
  for i in range(steps):
    prompts, _ = task.train_batch(rng, cfg.rollout.batch_size)
    engine.sync(state.params, i)
    state, _ = step_fn(state, teacher_params, batch_from_rollout(engine.generate(prompts, sampling, seed=i)))
    history.push(i + 1, state.params)
  return state, history


def parse_views(spec: str, warmup_steps: int, section: str) -> tuple[list[EngineView], int]:
  """';'-separated engine views and their largest lag, which the warmup must cover."""
  views = [EngineView.parse(s) for s in spec.split(";")]
  max_lag = max(v.lag for v in views)
  if warmup_steps < max_lag:
    raise UserError(f"a view asks for lag {max_lag} but {section}.warmup_steps={warmup_steps};"
                    f" raise warmup_steps to at least {max_lag}.")
  return views, max_lag


def run(cfg: ml_collections.ConfigDict, out_dir: str | None = None, progress: bool = True) -> dict:
  views, max_lag = parse_views(cfg.mismatch.sources, cfg.mismatch.warmup_steps, "mismatch")
  task = make_task(cfg)
  teacher, teacher_params = load_model("teacher", cfg, task)
  student, student_params = load_model("student", cfg, task)
  sampling = sampling_params(cfg)
  state, history = warmup_history(cfg, task, student, student_params, teacher, teacher_params,
                                  cfg.mismatch.warmup_steps, max_lag)
  measurer = Measurer(student, task, sampling, cfg.rollout.max_len)
  prompts = task.eval_set()[0][: cfg.mismatch.num_prompts]
  results = {"views": {}, "attribution": {}}
  for view in tqdm(views, desc="views", disable=not progress):
    metrics, batch = measurer.measure(view, history, state.params, prompts, seed=cfg.mismatch.seed)
    results["views"][str(view)] = metrics
    if len(view.sources()) > 1:
      results["attribution"][str(view)] = {
          "total": metrics["exact_kl"], **measurer.attribute(view, history, state.params, batch, metrics["exact_kl"])}
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "mismatch.json")
    with open(path + ".tmp", "w") as f:
      json.dump(results, f, indent=2)
    os.replace(path + ".tmp", path)
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
