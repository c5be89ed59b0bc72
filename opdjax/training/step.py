"""The OPD train step: a module-level pure function, jitted once with donated state."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from opdjax.models.decoder import Model
from opdjax.models.vocab import check_logits
from opdjax.parallel import rules
from opdjax.parallel.activations import traced_on
from opdjax.parallel.placement import Placement
from opdjax.rollout.base import SamplingParams
from opdjax.scoring.mismatch import sampled_metrics
from opdjax.scoring.rescore import TrainBatch, masked_mean
from opdjax.training.fused import fused_opd_loss, fused_served_loss
from opdjax.training.loss import SERVED_KEYS, LossConfig, sampling_transform

EXCLUDED_R = 20.0  # |r| of a sampled token the trainer's processed distribution excludes


WARMUP_FRACTION = 0.2  # the most of a schedule's steps that warmup may take


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """`total_steps` 0 (a run config's default): the run's `train.steps` (`for_run`); warmup is capped to
  WARMUP_FRACTION of the schedule either way."""

  learning_rate: float = 1e-4
  warmup_steps: int = 10
  total_steps: int = 1000
  end_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  max_grad_norm: float = 1.0


  def for_run(self, steps: int) -> OptimConfig:
    """The schedule a run of `steps` steps uses: `total_steps` 0 follows the run, warmup capped."""
    total = self.total_steps or steps
    return dataclasses.replace(self, total_steps=total,
                               warmup_steps=min(self.warmup_steps, max(1, int(WARMUP_FRACTION * total))))

  def note(self, steps: int) -> str | None:
    """One line when the schedule does not fit a run of `steps` steps (None when it does)."""
    used = self.for_run(steps)
    if used.warmup_steps < self.warmup_steps:
      return (f"opdjax: optim.warmup_steps={self.warmup_steps} is over {WARMUP_FRACTION:.0%} of the"
              f" {used.total_steps}-step schedule; warming up over {used.warmup_steps} steps.")
    if not self.total_steps or self.total_steps == steps:
      return None
    if steps <= used.warmup_steps:
      return (f"opdjax: the run ends at step {steps}, before the warmup (optim.warmup_steps={used.warmup_steps}):"
              f" the learning rate never reaches {self.learning_rate:g}. Leave optim.total_steps at 0 to follow"
              " train.steps.")
    if steps < self.total_steps:
      return (f"opdjax: the run ends at step {steps} of an optim.total_steps={self.total_steps} schedule: it never"
              " decays to its end. Leave optim.total_steps at 0 to follow train.steps.")
    return (f"opdjax: the run goes on {steps - self.total_steps} steps past the end of its optim.total_steps="
            f"{self.total_steps} schedule, at {self.end_lr_fraction:g} x the learning rate. Leave"
            " optim.total_steps at 0 to follow train.steps.")


class ScheduleState(NamedTuple):
  """The learning-rate schedule inside the optimizer state: its position (`count`, updates applied) and its
  hyperparameters, as arrays. The compiled step reads them as inputs, so runs that differ only in their schedule
  (`train.steps`, `optim.total_steps`, `optim.warmup_steps`, `optim.learning_rate`: a sweep, a resumed run given
  more steps) run one program; as Python constants each such run compiled its own step."""

  count: jax.Array  # int32
  peak: jax.Array  # float32: learning_rate
  warmup: jax.Array  # int32: warmup steps, >= 1
  decay: jax.Array  # float32: steps of the cosine part after the warmup, >= 1
  alpha: jax.Array  # float32: end / peak
  one_minus_alpha: jax.Array  # float32: 1 - alpha, rounded once as optax rounds it


def schedule_arrays(cfg: OptimConfig) -> dict[str, jax.Array]:
  """`cfg`'s warmup-cosine schedule as ScheduleState's arrays (those of optax.warmup_cosine_decay_schedule's
  arguments, rounded from the same Python floats)."""
  warmup = max(cfg.warmup_steps, 1)
  end = cfg.learning_rate * cfg.end_lr_fraction
  alpha = 0.0 if cfg.learning_rate == 0.0 else end / cfg.learning_rate
  return {"peak": jnp.asarray(cfg.learning_rate, jnp.float32), "warmup": jnp.asarray(warmup, jnp.int32),
          "decay": jnp.asarray(float(max(cfg.total_steps, warmup + 1) - warmup), jnp.float32),
          "alpha": jnp.asarray(alpha, jnp.float32), "one_minus_alpha": jnp.asarray(1 - alpha, jnp.float32)}


def scheduled_lr(s: ScheduleState) -> jax.Array:
  """The learning rate at update `s.count`: optax.warmup_cosine_decay_schedule(0, peak, warmup, total, end)'s
  float32 operations as XLA compiles them when its arguments are constants (the division by the cosine length
  becomes a product with its reciprocal): the same value, bit for bit (tests/test_optim_schedule.py)."""
  frac = 1 - jnp.clip(s.count, 0, s.warmup) / s.warmup
  warm = -s.peak * frac + s.peak
  count = jnp.minimum((s.count - s.warmup).astype(jnp.float32), s.decay)
  cosine = 0.5 * (1 + jnp.cos(jnp.pi * count * (1 / s.decay)))
  return jnp.where(s.count < s.warmup, warm, s.peak * (s.one_minus_alpha * cosine ** 1.0 + s.alpha))


def scale_by_schedule_state(cfg: OptimConfig) -> optax.GradientTransformation:
  """optax.scale_by_learning_rate(warmup_cosine_decay_schedule(...)) with the schedule held in its state
  (ScheduleState): the updates times -lr, the count advanced."""

  def init(params):
    del params
    return ScheduleState(count=jnp.zeros((), jnp.int32), **schedule_arrays(cfg))

  def update(updates, state, params=None):
    del params
    lr = scheduled_lr(state)
    updates = jax.tree.map(lambda g: jnp.array(-1 * lr, dtype=g.dtype) * g, updates)
    return updates, state._replace(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """AdamW with gradient clipping and the warmup-cosine schedule `cfg` names as it is (a run passes
  `cfg.for_run(train.steps)`); the schedule lives in the state (ScheduleState), not in the program."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.chain(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2), optax.add_decayed_weights(cfg.weight_decay),
                  scale_by_schedule_state(cfg)),
  )


def _is_schedule(x) -> bool:
  return isinstance(x, ScheduleState)


def learning_rate(opt_state) -> jax.Array | None:
  """The learning rate the next update of `opt_state` applies (None: an optimizer without ScheduleState)."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_schedule) if _is_schedule(x)]
  return scheduled_lr(found[0]) if found else None


def with_schedule(state, fresh):
  """`state` (a restored TrainState) with the schedule hyperparameters of `fresh` (a new state of this run's
  config) and its own count: a resumed run follows its config's schedule (a longer `train.steps` stretches it),
  as it did when the schedule was a constant of the step."""
  def take(old, new):
    return new._replace(count=old.count) if _is_schedule(old) else old
  return state.replace(opt_state=jax.tree.map(take, state.opt_state, fresh.opt_state, is_leaf=_is_schedule))


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState

  @classmethod
  def create(cls, params, optimizer: optax.GradientTransformation) -> TrainState:
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def create_state(placement: Placement, params, optimizer: optax.GradientTransformation) -> TrainState:
  """A fresh TrainState from (placed) `params`, created directly sharded: the optimizer's moments
  are born on the devices that own them, never whole on one device. Never aliases `params`."""
  if placement.mesh is None:  # the step donates its state: never the caller's own params
    return TrainState.create(jax.tree.map(jnp.copy, params), optimizer)

  def create(p):
    return TrainState.create(p, optimizer)

  shardings = placement.state_shardings(jax.eval_shape(create, params))
  return jax.jit(create, out_shardings=shardings)(params)


def train_step_shardings(placement: Placement, params, teacher_params, optimizer):
  """(in_shardings, out_shardings) of `train_step(state, teacher_params, batch)`, or None."""
  if placement.mesh is None:
    return None
  mesh = placement.mesh
  state = placement.state_shardings(jax.eval_shape(lambda p: TrainState.create(p, optimizer), params))
  teacher = None if teacher_params is None else rules.param_shardings(teacher_params, mesh)
  return (state, teacher, NamedSharding(mesh, rules.BATCH)), (state, rules.replicated(mesh))


def opd_loss(params, teacher_params, batch: TrainBatch, *, student: Model, teacher: Model,
             loss_cfg: LossConfig, sampling: SamplingParams | None = None):
  """Masked OPD loss and per-batch metrics. Teacher is a constant.

  `sampling`: how the engine that produced `rollout_logprobs` processed its logits (temperature,
  top-k, top-p). The trainer is scored on that same distribution for the importance weights and
  the `mismatch_*` metrics; the objective stays on the models' T = 1 distributions. None: T = 1,
  unprocessed. A batch with `teacher_hidden` (rollout.teacher_scoring='engine') carries the teacher's
  final hidden states from the engine's process (opdjax.rollout.jax.teacher): the teacher's layers do not
  run here, its output matrix and the fused loss do. A batch with `teacher_logprobs` carries a served
  teacher's answer (teacher.serve='vllm', opdjax.rollout.vllm.teacher): no teacher runs here at all
  (`teacher` and `teacher_params` are None).
  """
  loss, terms = opd_terms(params, teacher_params, batch, student=student, teacher=teacher, loss_cfg=loss_cfg,
                          sampling=sampling)
  return loss, opd_metrics(loss, terms, batch, loss_cfg)


def opd_terms(params, teacher_params, batch: TrainBatch, *, student: Model, teacher: Model, loss_cfg: LossConfig,
              sampling: SamplingParams | None = None):
  """`(loss, per-token terms [B, L])` of `opd_loss`, before the metrics are reduced from the terms."""
  h_s, _ = student.hidden(params, batch["tokens"], batch["positions"], batch["attention_mask"])
  mask = batch["loss_mask"]
  args = (batch["targets"], batch["rollout_logprobs"], mask, loss_cfg, jnp.dtype(student.cfg.dtype),
          sampling_transform(sampling, student.cfg.logit_size))
  if "teacher_logprobs" in batch:
    served = {k: jax.lax.stop_gradient(batch[k]) for k in SERVED_KEYS if k in batch}
    return fused_served_loss(h_s, student.output_matrix(params), served, *args)
  if "teacher_hidden" in batch:
    h_t = batch["teacher_hidden"]
  else:
    h_t, _ = teacher.hidden(teacher_params, batch["tokens"], batch["positions"], batch["attention_mask"])
  return fused_opd_loss(h_s, student.output_matrix(params), jax.lax.stop_gradient(h_t),
                        jax.lax.stop_gradient(teacher.output_matrix(teacher_params)), *args)


def opd_metrics(loss, terms: dict, batch: TrainBatch, loss_cfg: LossConfig) -> dict[str, jax.Array]:
  """The step's metrics from the whole batch's per-token terms (the same with or without micro-batches)."""
  mask = batch["loss_mask"]
  lp_s, lp_t = terms["student_logprobs"], terms["teacher_logprobs"]
  # Rollout vs trainer on the same tokens and the same processed distribution, from the forward
  # pass the loss already did.
  mismatch = mismatch_metrics(batch["rollout_logprobs"], terms["trainer_logprobs"], mask)
  signal = masked_mean(lp_s - lp_t, mask)
  return {
      "loss": loss,
      "reverse_kl": masked_mean(terms["reverse_kl"], mask),
      "entropy": masked_mean(terms["entropy"], mask),
      "is_weight_mean": masked_mean(terms["is_weight"], mask),
      "num_tokens": jnp.sum(mask),
      # The sampled reverse-KL signal OPD follows (T = 1) from the trainer's log-probs, and with the
      # engine's error on the same tokens added (mean(log q - log p_trainer) on the processed
      # distribution, = kl_k1_tok): their difference is the bias the mismatch puts into it.
      "opd_signal_trainer": signal,
      "opd_signal_rollout": signal + mismatch["mismatch_kl_k1_tok"],
      # The one sampled_rkl's advantage used (loss.student_logprobs): the form, recorded per step.
      "opd_signal": signal + mismatch["mismatch_kl_k1_tok"] if loss_cfg.student_logprobs == "rollout" else signal,
      **mismatch,
  }


def mismatch_metrics(rollout_logprobs, trainer_logprobs, mask) -> dict[str, jax.Array]:
  """`mismatch_*` metrics (`sampled_metrics`) of the engine vs the trainer on the same processed distribution.

  A sampled token the trainer's processed distribution excludes (a top-k / top-p boundary that
  moved: `trainer_logprobs` = -inf) counts at r = -EXCLUDED_R, the clamp `sampled_metrics` puts
  on its chi-square and ESS estimates; `mismatch_excluded_frac` says how often that happened.
  """
  mask = mask.astype(jnp.float32)
  excluded = (mask > 0) & ~jnp.isfinite(trainer_logprobs)
  lp_tr = jnp.where(excluded, rollout_logprobs - EXCLUDED_R, trainer_logprobs)
  metrics = {f"mismatch_{k}": v for k, v in sampled_metrics(rollout_logprobs, lp_tr, mask).items()}
  metrics["mismatch_excluded_frac"] = masked_mean(excluded, mask)
  return metrics


def train_step(state: TrainState, teacher_params, batch: TrainBatch, *, student: Model,
               teacher: Model, loss_cfg: LossConfig, optimizer: optax.GradientTransformation,
               skip_nonfinite: bool = False, sampling: SamplingParams | None = None, micro_batches: int = 1):
  """`(state, batch) -> (state, metrics)`; pure, jit with `make_train_step`. `micro_batches` > 1: the batch's
  gradient accumulated over that many micro-batches of its rows (`accumulate_gradients`), one update."""
  fn = functools.partial(opd_terms, student=student, teacher=teacher, loss_cfg=loss_cfg, sampling=sampling)
  grads, loss, terms = accumulate_gradients(jax.value_and_grad(fn, has_aux=True), state.params, teacher_params,
                                            batch, micro_batches)
  return apply_gradients(state, grads, opd_metrics(loss, terms, batch, loss_cfg), optimizer, skip_nonfinite)


def accumulate_gradients(grad_fn, params, teacher_params, batch: TrainBatch, micro_batches: int):
  """`(grads, loss, terms)` of the whole batch from `micro_batches` micro-batches of its rows, one at a time.

  Micro-batch j holds rows j, j + k, j + 2k, ... (k = micro_batches), so on a mesh each device keeps its own
  rows. Its loss is its masked mean over its own n_j tokens; scaled by n_j / N (N: the whole batch's tokens)
  the summed gradients are the gradient of the whole batch's masked mean, which is what the unsplit step
  takes. The per-token terms are put back in the batch's row order, so every metric is the whole batch's.
  Only `loss.baseline='loo'` sees less: the other rows of its own micro-batch (still unbiased; docs/objectives.md).
  """
  if micro_batches == 1:
    (loss, terms), grads = grad_fn(params, teacher_params, batch)
    return grads, loss, terms
  k = micro_batches
  total = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
  split = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)

  def body(acc, micro):
    (loss, terms), grads = grad_fn(params, teacher_params, micro)
    scale = jnp.sum(micro["loss_mask"]) / total
    acc = jax.tree.map(lambda a, g: a + scale * g.astype(jnp.float32), acc, grads)
    return acc, (scale * loss, terms)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grads, (losses, terms) = jax.lax.scan(body, zeros, split)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  terms = jax.tree.map(lambda t: jnp.swapaxes(t, 0, 1).reshape(-1, *t.shape[2:]), terms)
  return grads, jnp.sum(losses), terms


def apply_gradients(state: TrainState, grads, metrics: dict, optimizer: optax.GradientTransformation,
                    skip_nonfinite: bool = False):
  """One optimizer update; adds `grad_norm` (before clipping), `learning_rate` (this update's) and, with
  `skip_nonfinite`, `skipped`."""
  lr = learning_rate(state.opt_state)
  if lr is not None:
    metrics["learning_rate"] = lr
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics["grad_norm"] = optax.tree.norm(grads)
  new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  if skip_nonfinite:  # keep the old params and optimizer state; the step counter still advances
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    new = new.replace(params=jax.tree.map(lambda a, b: jnp.where(ok, a, b), params, state.params),
                      opt_state=jax.tree.map(lambda a, b: jnp.where(ok, a, b), opt_state, state.opt_state))
    metrics["skipped"] = 1.0 - ok.astype(jnp.float32)
  return new, metrics


def check_compatible(student: Model, teacher: Model | None) -> None:
  if teacher is not None:
    check_logits(student.cfg, teacher.cfg)


def make_train_step(student: Model, teacher: Model, loss_cfg: LossConfig,
                    optimizer: optax.GradientTransformation, skip_nonfinite: bool = False,
                    sampling: SamplingParams | None = None, shardings: tuple | None = None, micro_batches: int = 1):
  """The step jitted once, with the train state donated.

  `sampling`: the `SamplingParams` the rollouts are generated with, so that the importance
  weights and `mismatch_*` metrics compare the trainer with the engine on the same processed
  distribution (see `opd_loss`). None: the rollouts are T = 1 and unprocessed. `shardings`:
  (in_shardings, out_shardings) over a mesh (`train_step_shardings`); None: one device. `micro_batches`:
  train.micro_batches (`accumulate_gradients`).
  """
  check_compatible(student, teacher)
  fn = functools.partial(train_step, student=student, teacher=teacher, loss_cfg=loss_cfg,
                         optimizer=optimizer, skip_nonfinite=skip_nonfinite, sampling=sampling,
                         micro_batches=micro_batches)
  if shardings is None:
    return jax.jit(fn, donate_argnums=0)

  mesh = shardings[1][1].mesh  # the metrics' (replicated) sharding names the mesh
  return jax.jit(traced_on(fn, mesh), donate_argnums=0, in_shardings=shardings[0], out_shardings=shardings[1])
