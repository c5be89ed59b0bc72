"""GRPO: the RL baseline for the OPD-vs-RL comparison, on the same rollouts, re-scoring and step.

Each prompt is sampled `group_size` times (consecutive rows). A verifier gives every completion a
scalar reward r; the advantage of a completion is its reward against its own group's:

- `normalize_std=True` (GRPO): A = (r - mean_g) / (std_g + eps), std_g the unbiased (ddof=1)
  standard deviation of the group's rewards (TRL's and verl's convention);
- `normalize_std=False` (Dr. GRPO): A = r - mean_g, no division, so groups with nearly equal
  rewards are not amplified.
A group whose rewards are all equal carries no signal and gets A = 0 exactly.

Per completion token y_t the objective term is `-w_t * A * log p_trainer(y_t)`, with `A` the
sequence's advantage and `w_t` the trainer-vs-rollout importance weight of `opdjax.loss`, both held
constant. Given the rollouts' `sampling`, `w_t` and the `mismatch_*` metrics score the trainer on
the engine's processed distribution (temperature, top-k, top-p), as the OPD step does, so they
measure the engine's mismatch alone; the objective's log p is the model at `temperature`. The step
makes one optimizer update per batch of fresh samples, so the PPO ratio
p_theta / p_theta_old is exactly 1 where the gradient is taken and its clipping never acts: it is
left out. What remains of the off-policy gap is the rollout engine's mismatch, which `w` corrects.
The terms are reduced by a token-level masked mean over the whole batch,
`sum(m * term) / max(sum(m), 1)` (DAPO's token-level normalization, as Dr. GRPO recommends over
GRPO's per-sequence length normalization): every completion token weighs the same, so a long
completion is not down-weighted per token. This is the reduction the OPD loss uses, which keeps
the two objectives on one scale.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from opdjax.errors import UserError
from opdjax.models.decoder import Model
from opdjax.rollout.base import SamplingParams
from opdjax.scoring.rescore import TrainBatch, chunked_over_positions, masked_mean
from opdjax.training.loss import IS_MODES, importance_weights, processed_logprobs, sampling_transform
from opdjax.training.step import TrainState, apply_gradients, mismatch_metrics


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  group_size: int = 8  # samples per prompt, consecutive rows of the batch
  normalize_std: bool = True  # False: Dr. GRPO advantages r - mean_g
  is_correction: str = "none"  # none | tis | mis, as in LossConfig
  is_threshold: float = 2.0
  chunk: int = 256  # sequence positions per chunk of [B, chunk, V] logits
  # The policy whose log p(y) the objective raises: the model at this temperature. Set it to the
  # rollout temperature (the policy that sampled). The importance weights and mismatch metrics
  # follow the step's `sampling` instead (the engine's processed distribution).
  temperature: float = 1.0

  def __post_init__(self):
    if not isinstance(self.group_size, int) or self.group_size < 2:
      raise UserError(f"grpo.group_size={self.group_size!r}; use an int >= 2: the baseline is the group mean,"
                      " so a group of one always has advantage 0.")
    if self.is_correction not in IS_MODES:
      raise UserError(f"grpo.is_correction={self.is_correction!r}; choose one of {', '.join(IS_MODES)}.")
    if not self.is_threshold > 0:
      raise UserError(f"grpo.is_threshold must be > 0, got {self.is_threshold}.")
    if self.chunk < 1:
      raise UserError(f"grpo.chunk must be >= 1, got {self.chunk}.")
    if not self.temperature > 0:
      raise UserError(f"grpo.temperature must be > 0 (the trainer scores a distribution), got {self.temperature}.")


def group_advantages(rewards, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> jax.Array:
  """Advantages `[B]` fp32 of rewards `[B]` laid out as `B // group_size` consecutive groups."""
  r = jnp.asarray(rewards, jnp.float32)
  if r.ndim != 1 or group_size < 2 or r.shape[0] % group_size:
    raise UserError(f"rewards of shape {r.shape} with group_size={group_size}: need a 1-D batch that is a"
                    " multiple of group_size >= 2; build the prompts with repeat_prompts(prompts, group_size).")
  g = r.reshape(-1, group_size)
  a = g - jnp.mean(g, axis=1, keepdims=True)
  if normalize_std:
    a = a / (jnp.std(g, axis=1, ddof=1, keepdims=True) + eps)
  # Exactly 0 for an all-equal group (the mean's rounding would otherwise leave ~1e-8 / eps).
  flat = jnp.max(g, axis=1, keepdims=True) == jnp.min(g, axis=1, keepdims=True)
  return jnp.where(flat, 0.0, a).reshape(-1)


def repeat_prompts(prompts: Sequence[Sequence[int]], group_size: int) -> list[list[int]]:
  """Each prompt `group_size` times in a row: the layout `group_advantages` expects."""
  return [list(p) for p in prompts for _ in range(group_size)]


def repeat_references(references, group_size: int):
  """The task's references (e.g. addition pairs) repeated to match `repeat_prompts`."""
  if isinstance(references, np.ndarray):
    return np.repeat(references, group_size, axis=0)
  return [r for r in references for _ in range(group_size)]


def verifier_rewards(task, references, completions: Sequence[Sequence[int]]) -> np.ndarray:
  """Rewards `[B]` fp32: 1 where `task.is_correct(reference, completion)`, else 0."""
  if not task.has_verifier:
    raise UserError(f"{type(task).__name__} has no verifier (is_correct); GRPO needs a task with one,"
                    " e.g. task.name=addition.")
  return np.asarray([float(task.is_correct(r, c)) for r, c in zip(references, completions)], np.float32)


def _logprobs(student: Model, params, batch: TrainBatch, cfg: GrpoConfig, sampling: SamplingParams | None):
  """`(log p(y) at cfg.temperature, differentiable; the trainer on the processed distribution, constant)`.

  Both `[B, L]`, 0 off the loss mask, from one forward pass and the same chunk of logits.
  """
  h, _ = student.hidden(params, batch["tokens"], batch["positions"], batch["attention_mask"])

  def per_chunk(h_c, tgt_c):
    logits = student.logits(params, h_c)
    logp = jax.nn.log_softmax(logits / cfg.temperature, axis=-1)
    lp = jnp.take_along_axis(logp, tgt_c[..., None], axis=-1)[..., 0]
    lp_tr = jax.lax.stop_gradient(lp) if sampling is None else processed_logprobs(logits, tgt_c, sampling)
    return lp, lp_tr

  lp, lp_tr = chunked_over_positions(per_chunk, cfg.chunk, h, batch["targets"])
  on = batch["loss_mask"] > 0
  return jnp.where(on, lp, 0.0), jnp.where(on, lp_tr, 0.0)


def grpo_loss(params, batch: TrainBatch, advantages, *, student: Model, cfg: GrpoConfig,
              sampling: SamplingParams | None = None):
  """Masked GRPO loss `-sum(m * w * A * log p) / max(sum(m), 1)` and per-batch metrics.

  `advantages [B]` are per sequence (`group_advantages`) and, like the importance weights `w`,
  constant. One update per batch of fresh samples: the PPO ratio is 1, so there is no clipping.
  `sampling`: how the engine processed the logits behind `rollout_logprobs`; `w` and the
  `mismatch_*` metrics score the trainer on that distribution. None: the model at `cfg.temperature`.
  """
  mask = batch["loss_mask"].astype(jnp.float32)
  if jnp.shape(advantages) != mask.shape[:1]:
    raise UserError(f"advantages of shape {jnp.shape(advantages)} for a batch of {mask.shape[0]} sequences;"
                    " pass one advantage per row (group_advantages(rewards, group_size)).")
  # Off-mask entries are never read: garbage there (e.g. exp overflow) must not reach the sums.
  lp_r = jnp.where(mask > 0, batch["rollout_logprobs"], 0.0)
  lp_s, lp_tr = _logprobs(student, params, batch, cfg,
                          sampling_transform(sampling, student.cfg.logit_size, cfg.temperature))
  w = jnp.where(mask > 0, importance_weights(lp_tr, lp_r, cfg), 0.0)
  adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
  loss = masked_mean(-w * adv[:, None] * lp_s, mask)
  clipped = jnp.exp(lp_tr - lp_r) > cfg.is_threshold
  metrics = {
      "loss": loss,
      "advantage_abs_mean": jnp.mean(jnp.abs(adv)),
      "is_weight_mean": masked_mean(w, mask),
      # Tokens whose weight TIS truncated or MIS zeroed (0 without correction).
      "is_clip_frac": masked_mean(clipped, mask) if cfg.is_correction != "none" else jnp.zeros(()),
      "num_tokens": jnp.sum(mask),
      **mismatch_metrics(lp_r, lp_tr, mask),
  }
  return loss, metrics


def grpo_train_step(state: TrainState, batch: TrainBatch, advantages, *, student: Model, cfg: GrpoConfig,
                    optimizer: optax.GradientTransformation, skip_nonfinite: bool = False,
                    sampling: SamplingParams | None = None):
  """`(state, batch, advantages) -> (state, metrics)`; pure, jit with `make_grpo_step`."""
  grad_fn = jax.value_and_grad(functools.partial(grpo_loss, student=student, cfg=cfg, sampling=sampling),
                               has_aux=True)
  (_, metrics), grads = grad_fn(state.params, batch, advantages)
  return apply_gradients(state, grads, metrics, optimizer, skip_nonfinite)


def make_grpo_step(student: Model, cfg: GrpoConfig, optimizer: optax.GradientTransformation,
                   skip_nonfinite: bool = False, sampling: SamplingParams | None = None):
  """The GRPO step jitted once, with the train state donated: `step(state, batch, advantages)`.

  `sampling`: the `SamplingParams` the rollouts are generated with (see `grpo_loss`).

  Pass `advantages` as a float32 `[B]` array (what `group_advantages` returns); a weakly typed
  one (e.g. `jnp.full(shape, nan)` without a dtype) would compile the step a second time.
  """
  fn = functools.partial(grpo_train_step, student=student, cfg=cfg, optimizer=optimizer,
                         skip_nonfinite=skip_nonfinite, sampling=sampling)
  return jax.jit(fn, donate_argnums=0)
