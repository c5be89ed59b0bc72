"""Many short training runs from one start, at different engine views: calibration, validation, OPD vs GRPO.

`Runner` loads the task and models once and compiles each function once: the train step (OPD and,
when asked, GRPO), the engine's decode loop per engine-view model (compute dtype / KV rounding),
the held-out evaluation, and the weight perturbations — the noise sigma is a traced argument, so
a sigma sweep reuses one compiled transform. Every run starts from the same student params; the
run seed picks the training prompts, the sampling stream and the noise.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from opdjax.analyses.mismatch import sampling_params
from opdjax.errors import UserError
from opdjax.pipeline.build import load_model, make_task
from opdjax.pipeline.heldout import HeldOut
from opdjax.rollout import JaxEngine
from opdjax.scoring.rescore import batch_from_rollout
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig, TrainState, make_optimizer, make_train_step
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView, ViewTransform

ALGOS = ("opd", "grpo")


class Runner:
  def __init__(self, cfg: ml_collections.ConfigDict, steps: int, eval_every: int, progress: bool = True):
    self.cfg, self.steps, self.eval_every, self.progress = cfg, steps, max(1, eval_every), progress
    self.task = make_task(cfg)
    self.teacher, self.teacher_params = load_model("teacher", cfg, self.task)
    self.student, self.student_params = load_model("student", cfg, self.task)
    self.sampling = sampling_params(cfg)
    self.engine_kw = {"max_len": cfg.rollout.max_len, "pad_id": self.task.pad_id, "eos_ids": self.task.eos_ids}
    self._steps: dict[str, object] = {}
    self._optimizers: dict[str, object] = {}
    self._engines: dict = {}
    self._views = ViewTransform(self.student.cfg.num_layers)
    self._held_out = HeldOut(self.student, self.teacher, self.task, self.sampling, cfg.loss.chunk, cfg.seed + 7,
                             self.engine_kw)

  # --- compiled pieces, built on first use and reused by every run ---

  def _optimizer(self, algo: str):
    if algo not in self._optimizers:
      kw = {**self.cfg.optim.to_dict(), "total_steps": self.steps}
      if algo == "grpo" and self.cfg.grpo.learning_rate:
        kw["learning_rate"] = self.cfg.grpo.learning_rate
      self._optimizers[algo] = make_optimizer(OptimConfig(**kw))
    return self._optimizers[algo]

  def _step(self, algo: str):
    if algo not in self._steps:
      if algo == "opd":
        self._steps[algo] = make_train_step(self.student, self.teacher, LossConfig(**self.cfg.loss),
                                            self._optimizer(algo), skip_nonfinite=True)
      else:
        from opdjax.training import grpo

        self._steps[algo] = grpo.make_grpo_step(self.student, self.grpo_config(), self._optimizer(algo),
                                                skip_nonfinite=True)
    return self._steps[algo]

  def grpo_config(self):
    from opdjax.training import grpo

    g = self.cfg.grpo
    temp = self.cfg.rollout.temperature or 1.0
    return grpo.GrpoConfig(group_size=g.group_size, normalize_std=g.normalize_std, is_correction=g.is_correction,
                           is_threshold=g.is_threshold, chunk=self.cfg.loss.chunk, temperature=temp)

  def engine(self, view: EngineView) -> JaxEngine:
    vmodel = view.model(self.student)
    if vmodel.cfg not in self._engines:
      self._engines[vmodel.cfg] = JaxEngine(vmodel, None, **self.engine_kw)
    return self._engines[vmodel.cfg]

  def engine_params(self, view: EngineView, params, version: int, seed: int):
    """Noise (fresh each params version, seeded by the run) then quantization, as the engine sees it."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(view.noise_seed), seed), version)
    return self._views(view, params, key)

  def compiled_counts(self) -> dict[str, int]:
    """How many times each jitted function compiled (tests check sweeps do not add to these)."""
    out = {f"step_{k}": f._cache_size() for k, f in self._steps.items()}
    out.update(self._views.compiled())
    out["eval_loss"] = self._held_out.loss._cache_size()
    return out

  # --- evaluation and runs ---

  def evaluate(self, params) -> dict[str, float]:
    return self._held_out(params, self.teacher_params)[0]

  def train(self, view: EngineView, seed: int, algo: str = "opd", desc: str = "") -> list[dict]:
    """One run of `self.steps` steps with rollouts from `view`; a record per step (held-out
    quality at every `eval_every` steps and at the end)."""
    if algo not in ALGOS:
      raise UserError(f"algo={algo!r}; choose one of {', '.join(ALGOS)}.")
    step_fn, optimizer = self._step(algo), self._optimizer(algo)
    state = TrainState.create(jax.tree.map(jnp.copy, self.student_params), optimizer)  # steps donate it
    history = ParamsHistory(view.lag + 1)
    engine = self.engine(view)
    batch_size = self.cfg.rollout.batch_size
    group = self.cfg.grpo.group_size if algo == "grpo" else 1
    if batch_size % group:
      raise UserError(f"rollout.batch_size={batch_size} is not a multiple of grpo.group_size={group}.")
    records = [{"step": 0, **self.evaluate(state.params)}]
    step_metrics = []
    t0 = time.time()
    bar = tqdm(range(self.steps), desc=desc or f"{algo} {view} seed {seed}", unit="step", leave=False,
               disable=not self.progress)
    for step in bar:
      prompts, refs = self.task.train_batch(np.random.default_rng([self.cfg.seed, seed, step]), batch_size // group)
      version, params = step, state.params
      if view.lag:  # the history copies params (the step donates them)
        history.push(step, state.params)
        version, params = history.lagged(view.lag)
      engine.sync(self.engine_params(view, params, version, seed), version)
      if algo == "grpo":
        from opdjax.training import grpo

        prompts, refs = grpo.repeat_prompts(prompts, group), grpo.repeat_references(refs, group)
      rollout = engine.generate(prompts, self.sampling, seed=(seed * 1_000_003 + step) % (2**31))
      batch = batch_from_rollout(rollout)
      rec = {"step": step + 1, "params_lag": step - version}
      if algo == "opd":
        state, m = step_fn(state, self.teacher_params, batch)
        score = self.task.score(refs, rollout.completions())
      else:
        r = grpo.verifier_rewards(self.task, refs, rollout.completions())
        adv = grpo.group_advantages(jnp.asarray(r), group, self.cfg.grpo.normalize_std)
        state, m = step_fn(state, batch, adv)
        score = float(r.mean())
      step_metrics.append(m)  # read to the host after the run: no sync per step
      if score is not None:
        rec["train_accuracy"] = score
      if (step + 1) % self.eval_every == 0 or step + 1 == self.steps:
        rec.update(self.evaluate(state.params))
      rec["elapsed_s"] = round(time.time() - t0, 3)
      records.append(rec)
    for rec, m in zip(records[1:], jax.device_get(step_metrics)):
      rec.update({k: float(v) for k, v in m.items()})
    return records


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
  collapsed = nonfinite > 0 or (best is not None and best > 0.1 and final < collapse_fraction * best)
  finite = norms[np.isfinite(norms)]
  return Stability(collapsed, nonfinite, spikes, float(finite.max()) if finite.size else float("nan"), best, final)
