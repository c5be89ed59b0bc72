"""OPD objectives, per token, in fp32.

Notation per position: p_s student, p_t teacher (next-token distributions), y the
sampled target, w an importance weight. Every objective returns a per-token term;
the step reduces it with a masked mean `sum(m * w * term) / max(sum(m), 1)`.

- `sampled_rkl`: policy-gradient form of reverse KL on the sampled token (the
  "on-policy distillation" estimator). Advantage a = -(log p_s(y) - log p_t(y)),
  held constant; term = -a * log p_s(y). Its gradient is the single-sample
  estimate of grad KL(p_s || p_t) along the student's own trajectory. Two variance
  reductions keep its expectation: `baseline='loo'` subtracts from a the masked mean
  of the other rows' advantages at the same position (independent of this row's y,
  so E[b grad log p_s(y)] = 0); `student_term='exact'` samples only the teacher's
  half: a = log p_t(y) and the student's half E_y[log p_s(y) grad log p_s(y)] =
  grad sum_v p_s log p_s is taken over the whole vocabulary the trainer holds
  (term = -sg(a - b) log p_s(y) + sum_v p_s log p_s). `student_logprobs` says where the
  advantage's log p_s(y) comes from: `trainer` (the trainer's re-scoring: verl, slime) or
  `rollout` (the engine's reported log-prob q(y), `rollout_logprobs`: a = log p_t(y) - log q(y),
  the tinker cookbook's form, no student recompute for the signal). The gradient's log p_s(y) is
  always the trainer's; with `rollout` the engine's mismatch enters what the student is taught,
  not only which prefixes it sees (docs/objectives.md, "Where the student's log-prob comes from").
- `full_rkl`: exact KL(p_s || p_t) = sum_v p_s (log p_s - log p_t) per position.
- `topk_rkl`: the same over the top-k support S of the teacher (or student) plus
  one tail bucket holding the mass outside S for each side.
- `forward_kl`: KL(p_t || p_s) = sum_v p_t (log p_t - log p_s).
- `jsd`: generalized JSD(beta) = beta KL(p_t || m) + (1 - beta) KL(p_s || m) with
  m = beta p_t + (1 - beta) p_s (beta in (0, 1)).

Importance correction (trainer vs rollout engine, same tokens): w = exp(log
p_trainer(y) - log p_rollout(y)), held constant; `tis` truncates it at C, `mis`
zeroes tokens whose weight exceeds C. Both sides are on the distribution the engine
sampled from (temperature, top-k, top-p applied: `sampling`), so w measures the
engine's mismatch alone; the objectives above stay on the models' own (T = 1)
distributions (docs/objectives.md, "Temperature").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from opdjax.errors import UserError
from opdjax.rollout.base import SamplingParams
from opdjax.rollout.sampling import sampling_logprobs

IS_MODES = ("none", "tis", "mis")
BASELINES = ("none", "loo")
STUDENT_LOGPROBS = ("trainer", "rollout")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  kind: str = "full_rkl"
  topk: int = 16
  topk_support: str = "teacher"  # teacher | student
  jsd_beta: float = 0.5
  is_correction: str = "none"  # none | tis | mis
  is_threshold: float = 2.0
  baseline: str = "none"  # sampled_rkl: none | loo (the other rows' mean advantage at the same position)
  student_term: str = "sampled"  # sampled_rkl: sampled | exact (the student's half from its whole distribution)
  student_logprobs: str = "trainer"  # sampled_rkl's advantage: trainer (re-scored) | rollout (the engine's q(y))
  chunk: int = 256  # sequence positions per chunk of [B, chunk, V] logits

  def __post_init__(self):
    if self.kind not in OBJECTIVES:  # the registry below: an unregistered kind never reaches the step
      raise UserError(f"loss.kind={self.kind!r}; choose one of {', '.join(OBJECTIVES)}.")
    if self.is_correction not in IS_MODES:
      raise UserError(f"loss.is_correction={self.is_correction!r}; choose one of {', '.join(IS_MODES)}.")
    if self.baseline not in BASELINES:
      raise UserError(f"loss.baseline={self.baseline!r}; choose one of {', '.join(BASELINES)}.")
    if self.student_term not in ("sampled", "exact"):
      raise UserError(f"loss.student_term={self.student_term!r}; choose 'sampled' or 'exact'.")
    if self.student_logprobs not in STUDENT_LOGPROBS:
      raise UserError(f"loss.student_logprobs={self.student_logprobs!r}; choose one of {', '.join(STUDENT_LOGPROBS)}.")
    if self.student_logprobs == "rollout" and (self.kind != "sampled_rkl" or self.student_term != "sampled"):
      raise UserError(f"loss.student_logprobs='rollout' puts the engine's log-prob of the sampled token into"
                      f" sampled_rkl's advantage; loss.kind={self.kind!r} with loss.student_term="
                      f"{self.student_term!r} has no such log-prob: use loss.kind='sampled_rkl' with"
                      " loss.student_term='sampled', or loss.student_logprobs='trainer'.")
    if self.topk_support not in ("teacher", "student"):
      raise UserError(f"loss.topk_support={self.topk_support!r}; choose 'teacher' or 'student'.")
    if not 0.0 < self.jsd_beta < 1.0:
      raise UserError(f"loss.jsd_beta must be in (0, 1), got {self.jsd_beta}.")
    if self.chunk < 1:
      raise UserError(f"loss.chunk must be >= 1, got {self.chunk}.")
    if self.topk < 1:
      raise UserError(f"loss.topk must be >= 1, got {self.topk}.")


def _kl(logp_a, logp_b):
  """sum_v p_a (log p_a - log p_b) over the last axis."""
  return jnp.sum(jnp.exp(logp_a) * (logp_a - logp_b), axis=-1)


def _topk_rkl(logp_s, logp_t, cfg: LossConfig):
  side = jax.lax.stop_gradient(logp_t if cfg.topk_support == "teacher" else logp_s)
  kth = jax.lax.top_k(side, cfg.topk)[0][..., -1:]
  in_s = side >= kth  # ties at the k-th value join the support
  inside = jnp.sum(jnp.where(in_s, jnp.exp(logp_s) * (logp_s - logp_t), 0.0), axis=-1)
  tail_s = jax.nn.logsumexp(jnp.where(in_s, -jnp.inf, logp_s), axis=-1)
  tail_t = jax.nn.logsumexp(jnp.where(in_s, -jnp.inf, logp_t), axis=-1)
  finite = jnp.isfinite(tail_s) & jnp.isfinite(tail_t)
  tail_s = jnp.where(finite, tail_s, 0.0)
  tail_t = jnp.where(finite, tail_t, 0.0)
  return inside + jnp.where(finite, jnp.exp(tail_s) * (tail_s - tail_t), 0.0)


SERVED_KEYS = ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")
# The teacher's tail mass outside its returned top-K is 1 - sum(top-K probabilities), floored here: a server's
# fp32 log-prob of a likely token is logit - logsumexp, both of order 10, so it carries an absolute error of
# about 1e-6, and a remainder below that is rounding, not mass (docs/served_teacher.md, "The tail").
TAIL_FLOOR = 1e-6


def _sampled_rkl(logp_s, lp_s, lp_t, mask, cfg: LossConfig, lp_q=None):
  """The per-token term of `sampled_rkl` (module docstring): -sg(a - b) log p_s(y), with a = log p_t(y) -
  log p_s(y), or a = log p_t(y) plus the exact -H(p_s) with `student_term='exact'`; b the `baseline`.
  `lp_q`: the engine's log-prob of y, which replaces the trainer's in `a` with `student_logprobs='rollout'`."""
  if cfg.student_logprobs == "rollout" and lp_q is None:
    raise ValueError("loss.student_logprobs='rollout' needs the rollout's log-probs (rollout_lp)")
  own = lp_q if cfg.student_logprobs == "rollout" else lp_s
  a = jax.lax.stop_gradient(lp_t if cfg.student_term == "exact" else lp_t - own)
  if cfg.baseline == "loo":
    if mask is None:
      raise ValueError("loss.baseline='loo' needs the loss mask (the rows' tokens to average over)")
    a = a - loo_mean(a, jax.lax.stop_gradient(mask))
  term = -a * lp_s
  return term + jnp.sum(jnp.exp(logp_s) * logp_s, axis=-1) if cfg.student_term == "exact" else term


def loo_mean(x, mask):
  """Per position, the masked mean of `x` over the other rows (axis 0); 0 where no other row has a token."""
  m = mask.astype(jnp.float32)
  total, count = jnp.sum(m * x, axis=0), jnp.sum(m, axis=0)
  return (total - m * x) / jnp.maximum(count - m, 1.0)


def served_terms(logits_s, teacher: dict, targets, cfg: LossConfig, mask=None, rollout_lp=None) -> dict[str, jax.Array]:
  """`per_token_terms` with a served teacher: `teacher` holds what its server returned per position
  (`teacher_logprobs`: the log-prob of the sampled target; for `topk_rkl` also `teacher_topk_ids` /
  `teacher_topk_logprobs`: its top-K, K = loss.topk). `sampled_rkl` is exact (it needs only the target's
  log-prob). `topk_rkl` sums over the teacher's top-K support S plus one tail bucket per side: the
  student's tail is its exact mass outside S, the teacher's is 1 - sum_S p_t (floored at TAIL_FLOOR),
  the rule the trainer-side `topk_rkl` uses with the teacher's full distribution; at K = V it is the
  full reverse KL. `reverse_kl` is the sampled-token estimate log p_s(y) - log p_t(y) (unbiased for the
  per-position reverse KL on the student's own samples), whatever K."""
  logp_s = jax.nn.log_softmax(logits_s.astype(jnp.float32), axis=-1)
  lp_s = jnp.take_along_axis(logp_s, targets[..., None], axis=-1)[..., 0]
  lp_t = jax.lax.stop_gradient(teacher["teacher_logprobs"].astype(jnp.float32))
  served = OBJECTIVES[cfg.kind].served
  if served is None:  # the config's check refuses this first (Config.check, teacher placements)
    raise UserError(refusal(SERVER_ANSWER, SERVER_WHERE, cfg))
  term = (_sampled_rkl(logp_s, lp_s, lp_t, mask, cfg, rollout_lp) if cfg.student_logprobs == "rollout"
          else served(logp_s, lp_s, lp_t, teacher, mask, cfg))
  entropy = -jnp.sum(jnp.exp(logp_s) * logp_s, axis=-1)
  return {"term": term, "reverse_kl": jax.lax.stop_gradient(lp_s - lp_t), "entropy": jax.lax.stop_gradient(entropy),
          "trainer_logprobs": lp_s, "teacher_logprobs": lp_t}


def mass_outside(logp_k):
  """1 - sum(exp(logp_k)) over the last axis without cancellation: -expm1 of the top-K's logsumexp, whose
  log(1 + the others' share) comes from log1p (a peaked teacher's tail of 1e-5 keeps its digits in fp32)."""
  top = jnp.max(logp_k, axis=-1, keepdims=True)
  first = jnp.arange(logp_k.shape[-1]) == jnp.argmax(logp_k, axis=-1)[..., None]
  others = jnp.sum(jnp.where(first, 0.0, jnp.exp(logp_k - top)), axis=-1)
  return -jnp.expm1(top[..., 0] + jnp.log1p(others))


def _served_topk_rkl(logp_s, teacher: dict):
  """`topk_rkl` from a served teacher's top-K (see `served_terms`)."""
  ids = teacher["teacher_topk_ids"]
  lpt_k = jax.lax.stop_gradient(teacher["teacher_topk_logprobs"].astype(jnp.float32))
  lps_k = jnp.take_along_axis(logp_s, ids, axis=-1)
  inside = jnp.sum(jnp.exp(lps_k) * (lps_k - lpt_k), axis=-1)
  in_s = jnp.put_along_axis(jnp.zeros(logp_s.shape, bool), ids, True, axis=-1, inplace=False)
  tail_s = jax.nn.logsumexp(jnp.where(in_s, -jnp.inf, logp_s), axis=-1)
  tail_t = jnp.log(jnp.maximum(mass_outside(lpt_k), TAIL_FLOOR))
  present = jnp.isfinite(tail_s)
  tail_s = jnp.where(present, tail_s, 0.0)
  return inside + jnp.where(present, jnp.exp(tail_s) * (tail_s - tail_t), 0.0)


def _jsd(logp_s, logp_t, cfg: LossConfig):
  b = cfg.jsd_beta
  logm = jnp.logaddexp(jnp.log(b) + logp_t, jnp.log1p(-b) + logp_s)
  return b * _kl(logp_t, logm) + (1 - b) * _kl(logp_s, logm)


# What a teacher gives the objective, per position: its logits (the trainer's own teacher, or the hidden states
# the engine's side hands back, to which the trainer applies the head) give its whole distribution; a vLLM
# server's answer (`served_terms`' input) the sampled token's log-prob and its own top-K (prompt_logprobs).
# Which placement gives which, and its name in words, is the config's (opdjax.config.schema.TEACHER_PLACEMENTS,
# asked through the teacher seam, opdjax.pipeline.teacher): nothing here knows where a run's teacher is.
SAMPLED, TOPK, STUDENT_IDS, FULL = "sampled-token log-prob", "teacher top-K", "log-probs at student-chosen ids", \
    "full distribution"
FROM_LOGITS = frozenset({SAMPLED, TOPK, STUDENT_IDS, FULL})
SERVER_ANSWER = frozenset({SAMPLED, TOPK})
SERVER_WHERE = "served by vLLM (teacher.serve=vllm)"  # the teacher whose answer `served_terms` reads, in words


@dataclasses.dataclass(frozen=True)
class Objective:
  """One registered objective: what it needs from the teacher (`needs(cfg)`: a set of SAMPLED, TOPK,
  STUDENT_IDS, FULL), its per-token term from both distributions (`term(logp_s, logp_t, lp_s, lp_t, rkl, mask,
  cfg)`) and, where a served teacher's answer suffices, from that answer (`served(logp_s, lp_s, lp_t, teacher,
  mask, cfg)`; None: it needs more than a server returns)."""

  name: str
  needs: object
  term: object
  served: object = None


OBJECTIVES: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
  if objective.name in OBJECTIVES:
    raise ValueError(f"objective {objective.name!r} is registered twice")
  OBJECTIVES[objective.name] = objective
  return objective


register(Objective("sampled_rkl", lambda cfg: frozenset({SAMPLED}),
                   lambda logp_s, logp_t, lp_s, lp_t, rkl, m, cfg: _sampled_rkl(logp_s, lp_s, lp_t, m, cfg),
                   lambda logp_s, lp_s, lp_t, teacher, m, cfg: _sampled_rkl(logp_s, lp_s, lp_t, m, cfg)))
register(Objective("full_rkl", lambda cfg: frozenset({FULL}), lambda logp_s, logp_t, lp_s, lp_t, rkl, m, cfg: rkl))
register(Objective("topk_rkl", lambda cfg: frozenset({TOPK if cfg.topk_support == "teacher" else STUDENT_IDS}),
                   lambda logp_s, logp_t, lp_s, lp_t, rkl, m, cfg: _topk_rkl(logp_s, logp_t, cfg),
                   lambda logp_s, lp_s, lp_t, teacher, m, cfg: _served_topk_rkl(logp_s, teacher)))
register(Objective("forward_kl", lambda cfg: frozenset({FULL}),
                   lambda logp_s, logp_t, lp_s, lp_t, rkl, m, cfg: _kl(logp_t, logp_s)))
register(Objective("jsd", lambda cfg: frozenset({FULL}),
                   lambda logp_s, logp_t, lp_s, lp_t, rkl, m, cfg: _jsd(logp_s, logp_t, cfg)))


def feeds(provides: frozenset, cfg: LossConfig) -> bool:
  """A teacher that gives `provides` (FROM_LOGITS, SERVER_ANSWER) gives what objective `cfg` needs (a registered
  term too)."""
  objective = OBJECTIVES[cfg.kind]
  return objective.needs(cfg) <= provides and (FULL in provides or objective.served is not None)


def fed_by(provides: frozenset) -> list[str]:
  """The objectives (with their default settings) a teacher that gives `provides` feeds."""
  return [k for k in OBJECTIVES if feeds(provides, LossConfig(kind=k))]


def refusal(provides: frozenset, where: str, cfg: LossConfig) -> str | None:
  """One line refusing objective `cfg` with a teacher that gives `provides`, placed `where` (in words), naming
  what that placement can feed; None when it feeds it."""
  if feeds(provides, cfg):
    return None
  missing = sorted(OBJECTIVES[cfg.kind].needs(cfg) - provides) or ["answer in a form it takes (no served"
                                                                   " term is registered)"]
  what = f"loss.kind={cfg.kind!r}" + (f" with loss.topk_support={cfg.topk_support!r}" if cfg.kind == "topk_rkl" else "")
  return (f"{what} needs the teacher's {' and '.join(missing)}, which a teacher {where} does"
          f" not give; this placement feeds {', '.join(fed_by(provides))} (loss.topk_support='teacher'), or move the"
          " teacher (teacher.serve=trainer).")


def per_token_terms(logits_s, logits_t, targets, cfg: LossConfig, mask=None, rollout_lp=None) -> dict[str, jax.Array]:
  """Per-position objective term and diagnostics from `[..., V]` logits.

  `logits_t` is treated as a constant (teacher); gradients flow through `logits_s`. `rollout_lp`: the
  engine's log-prob of each target, which `loss.student_logprobs='rollout'` puts into the advantage.
  """
  logp_s = jax.nn.log_softmax(logits_s.astype(jnp.float32), axis=-1)
  logp_t = jax.lax.stop_gradient(jax.nn.log_softmax(logits_t.astype(jnp.float32), axis=-1))
  lp_s = jnp.take_along_axis(logp_s, targets[..., None], axis=-1)[..., 0]
  lp_t = jnp.take_along_axis(logp_t, targets[..., None], axis=-1)[..., 0]
  rkl = _kl(logp_s, logp_t)
  term = (_sampled_rkl(logp_s, lp_s, lp_t, mask, cfg, rollout_lp) if cfg.student_logprobs == "rollout"
          else OBJECTIVES[cfg.kind].term(logp_s, logp_t, lp_s, lp_t, rkl, mask, cfg))
  entropy = -jnp.sum(jnp.exp(logp_s) * logp_s, axis=-1)
  return {"term": term, "reverse_kl": jax.lax.stop_gradient(rkl), "entropy": jax.lax.stop_gradient(entropy),
          "trainer_logprobs": lp_s, "teacher_logprobs": lp_t}


def importance_weights(trainer_lp, rollout_lp, cfg: LossConfig):
  """Constant per-token weights correcting rollout-engine vs trainer mismatch."""
  if cfg.is_correction == "none":
    return jnp.ones_like(trainer_lp)
  w = jnp.exp(jax.lax.stop_gradient(trainer_lp) - rollout_lp)
  if cfg.is_correction == "tis":
    return jnp.minimum(w, cfg.is_threshold)
  return jnp.where(w <= cfg.is_threshold, w, 0.0)


def sampling_transform(sampling: SamplingParams | None, vocab_size: int,
                       temperature: float = 1.0) -> SamplingParams | None:
  """`sampling` where its processed distribution differs from a plain softmax at `temperature`, else None.

  None means the objective's own log-probs already are the rollout's distribution: no second
  transform to run. A greedy engine (`temperature == 0`) reports the unscaled model.
  """
  if sampling is None:
    return None
  scale = sampling.temperature if sampling.temperature > 0 else 1.0
  truncates = sampling.temperature > 0 and (0 < sampling.top_k < vocab_size or sampling.top_p < 1.0)
  return sampling if truncates or scale != temperature else None


def processed_logprobs(logits, targets, sampling: SamplingParams):
  """fp32 log-prob of each target under the engine's processed distribution (a constant).

  -inf where top-k / top-p removes the target: the trainer's processed distribution excludes it.
  """
  logp = sampling_logprobs(jax.lax.stop_gradient(logits), sampling)
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
