"""The OPD loss with a served teacher (teacher.serve='vllm'): what its server returns per position (the
sampled target's log-prob, its top-K) feeds `sampled_rkl` exactly and `topk_rkl` with the documented
tail rule; checked against the trainer-side loss on the same teacher and against float64 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.errors import UserError
from opdjax.training.fused import fused_opd_loss, fused_served_loss
from opdjax.training.loss import TAIL_FLOOR, LossConfig

B, L, D, V = 3, 7, 8, 11


def _case(seed, t_scale=1.5):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
  h_s, w_s, h_t, w_t = f(B, L, D), f(D, V) * 0.7, f(B, L, D), f(D, V) * t_scale
  targets = jnp.asarray(rng.integers(0, V, size=(B, L)), jnp.int32)
  mask = jnp.asarray(rng.random((B, L)) < 0.75, jnp.float32).at[:, 0].set(0.0)
  return h_s, w_s, h_t, w_t, targets, mask


def served_answer(h_t, w_t, targets, mask, k):
  """What a served teacher returns in the batch layout: the target's log-prob, the top-K by rank, and the
  finite filler off the mask (opdjax.rollout.vllm.teacher)."""
  logp = np.asarray(jax.nn.log_softmax(jnp.einsum("bld,dv->blv", h_t, w_t, precision="highest"), -1))
  m = np.asarray(mask) > 0
  out = {"teacher_logprobs": np.where(m, np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0], 0.0)}
  if k:
    ids = np.argsort(-logp, axis=-1, kind="stable")[..., :k]
    out["teacher_topk_ids"] = np.where(m[..., None], ids, np.arange(k)).astype(np.int32)
    out["teacher_topk_logprobs"] = np.where(m[..., None], np.take_along_axis(logp, ids, -1), -np.log(V))
  return {key: jnp.asarray(v, jnp.int32 if key.endswith("ids") else jnp.float32) for key, v in out.items()}, logp


def _losses(kind, k, seed=0, t_scale=1.5, **opts):
  h_s, w_s, h_t, w_t, targets, mask = _case(seed, t_scale)
  answer, logp_t = served_answer(h_t, w_t, targets, mask, k)
  zeros = jnp.zeros((B, L), jnp.float32)

  def trainer(h_s, w_s, trainer_kind):
    cfg = LossConfig(kind=trainer_kind, topk=k or 1, chunk=3, **opts)
    return fused_opd_loss(h_s, w_s, h_t, w_t, targets, zeros, mask, cfg, jnp.float32)[0]

  def served(h_s, w_s):
    cfg = LossConfig(kind=kind, topk=k or 1, chunk=3, **opts)
    return fused_served_loss(h_s, w_s, answer, targets, zeros, mask, cfg, jnp.float32)[0]

  return (h_s, w_s, targets, mask, logp_t, answer), trainer, served


def _value_and_grads(fn, h_s, w_s, *extra):
  return jax.value_and_grad(lambda h, w: fn(h, w, *extra), argnums=(0, 1))(h_s, w_s)


@pytest.mark.parametrize("opts", [{}, {"baseline": "loo", "student_term": "exact"}], ids=["plain", "loo-exact"])
def test_sampled_rkl_from_the_served_target_logprob_equals_the_trainer_teachers_loss_and_gradients(opts):
  (h_s, w_s, *_), trainer, served = _losses("sampled_rkl", 0, **opts)
  a, ga = _value_and_grads(trainer, h_s, w_s, "sampled_rkl")
  b, gb = _value_and_grads(served, h_s, w_s)
  assert abs(float(a)) > 1e-3
  np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
  for x, y in zip(ga, gb):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7)


def test_topk_rkl_at_k_equal_to_the_vocabulary_is_the_full_reverse_kl():
  (h_s, w_s, *_), trainer, served = _losses("topk_rkl", V)
  full, g_full = _value_and_grads(trainer, h_s, w_s, "full_rkl")
  got, g_got = _value_and_grads(served, h_s, w_s)
  np.testing.assert_allclose(float(got), float(full), rtol=1e-5)
  for x, y in zip(g_full, g_got):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)


def _reference_topk(h_s, w_s, targets, mask, answer, k):
  """The documented tail rule in float64: KL over the teacher's top-K plus one tail bucket a side, the
  teacher's tail 1 - sum of its top-K probabilities floored at TAIL_FLOOR."""
  logits = np.einsum("bld,dv->blv", np.asarray(h_s, np.float64), np.asarray(w_s, np.float64))
  logp_s = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
      -1, keepdims=True)
  ids = np.asarray(answer["teacher_topk_ids"])
  lpt = np.asarray(answer["teacher_topk_logprobs"], np.float64)
  lps = np.take_along_axis(logp_s, ids, -1)
  inside = (np.exp(lps) * (lps - lpt)).sum(-1)
  tail_s = 1.0 - np.exp(lps).sum(-1)
  tail_t = np.maximum(1.0 - np.exp(lpt).sum(-1), TAIL_FLOOR)
  term = inside + tail_s * (np.log(tail_s) - np.log(tail_t))
  m = np.asarray(mask, np.float64)
  return (term * m).sum() / max(m.sum(), 1.0)


def test_topk_rkl_at_small_k_follows_the_tail_rule_in_float64_and_differs_from_the_full_kl():
  # A peaked teacher (tails down to 1e-6 at some positions): the rule on the server's fp32 numbers, exactly.
  (h_s, w_s, targets, mask, logp_t, answer), trainer, served = _losses("topk_rkl", 3)
  got = float(served(h_s, w_s))
  assert np.exp(logp_t).max() > 1 - 1e-4  # a position whose tail mass 1 - sum(top-3) would cancel in fp32
  # rtol: XLA:CPU's vectorized exp/log differ by CPU (6.5e-6 seen on an EPYC family 25 model 1, under 2e-6 on
  # model 17); the tail taken as 1 - sum(top-3) in fp32, the error this guards, is off by 1.6e-4 here.
  np.testing.assert_allclose(got, _reference_topk(h_s, w_s, targets, mask, answer, 3), rtol=2e-5)
  full = float(trainer(h_s, w_s, "full_rkl"))
  assert abs(got - full) > 1e-3 * abs(full)  # K = 3 of 11 loses mass into the buckets: the test has power
  # A flatter teacher (every tail far above the floor): the trainer's topk_rkl over the same support with its
  # exact tail is the same rule.
  (h_s, w_s, *_), trainer, served = _losses("topk_rkl", 3, seed=1, t_scale=0.5)
  np.testing.assert_allclose(float(served(h_s, w_s)), float(trainer(h_s, w_s, "topk_rkl")), rtol=1e-5)


def test_a_served_teacher_refuses_the_objectives_that_need_its_whole_distribution():
  (h_s, w_s, targets, mask, _, answer), _, _ = _losses("sampled_rkl", 0)
  for kind in ("full_rkl", "forward_kl", "jsd"):
    with pytest.raises(UserError, match="sampled_rkl, topk_rkl"):
      fused_served_loss(h_s, w_s, answer, targets, jnp.zeros((B, L)), mask, LossConfig(kind=kind), jnp.float32)
