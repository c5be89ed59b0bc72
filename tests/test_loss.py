"""OPD objectives against a float64 NumPy reference written from opdjax/loss.py's docstring."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, central_diff, log_softmax

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig, positions_from_mask
from opdjax.rollout import SamplingParams
from opdjax.scoring.rescore import chunked_over_positions, masked_mean
from opdjax.training.fused import fused_opd_loss
from opdjax.training.loss import (
  IS_MODES,
  OBJECTIVES,
  LossConfig,
  importance_weights,
  per_token_terms,
  sampling_transform,
)
from opdjax.training.step import opd_loss

B, T, V = 2, 3, 7
MASK = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
IS_THRESHOLD = 2.0


# --- float64 reference ------------------------------------------------------

def pick(x, y):
  return np.take_along_axis(x, y[..., None], axis=-1)[..., 0]


def ref_sampling_logprobs(z, temperature, top_k, top_p):
  """The engine's processed distribution, from SamplingParams' docstring: temperature, top-k, top-p."""
  z = z / temperature
  if top_k:
    z = np.where(z < np.sort(z, -1)[..., -top_k:][..., :1], -np.inf, z)
  if top_p < 1:
    desc = -np.sort(-z, -1)
    p = np.exp(log_softmax(desc))
    keep = np.cumsum(p, -1) - p < top_p  # the smallest prefix reaching top_p
    z = np.where(z < np.min(np.where(keep, desc, np.inf), -1, keepdims=True), -np.inf, z)
  kept = np.isfinite(z)
  return np.where(kept, log_softmax(np.where(kept, z, -1e300)), -np.inf)


def ref_constants(zs0, zt, y, rollout_lp, cfg, trainer_lp=None):
  """What the loss holds fixed (stop-gradient), evaluated at the base student logits.

  `trainer_lp`: the trainer's log-probs the IS weight compares with the rollout's (default: T = 1).
  """
  ls0, lt = log_softmax(zs0), log_softmax(zt)
  side = lt if cfg.topk_support == "teacher" else ls0
  top = np.argsort(-side, axis=-1)[..., :cfg.topk]
  support = np.zeros(zs0.shape, bool)
  np.put_along_axis(support, top, True, axis=-1)
  w = np.exp((pick(ls0, y) if trainer_lp is None else trainer_lp) - rollout_lp)
  if cfg.is_correction == "tis":
    w = np.minimum(w, cfg.is_threshold)
  elif cfg.is_correction == "mis":
    w = np.where(w <= cfg.is_threshold, w, 0.0)
  elif cfg.is_correction == "none":
    w = np.ones_like(w)
  return {"advantage": pick(lt, y) - pick(ls0, y), "support": support, "w": w}


def ref_term(zs, zt, y, cfg, const):
  ls, lt = log_softmax(zs), log_softmax(zt)
  ps, pt = np.exp(ls), np.exp(lt)
  if cfg.kind == "sampled_rkl":
    return -const["advantage"] * pick(ls, y)
  if cfg.kind == "full_rkl":
    return np.sum(ps * (ls - lt), -1)
  if cfg.kind == "forward_kl":
    return np.sum(pt * (lt - ls), -1)
  if cfg.kind == "jsd":
    b = cfg.jsd_beta
    logm = np.log(b * pt + (1 - b) * ps)
    return b * np.sum(pt * (lt - logm), -1) + (1 - b) * np.sum(ps * (ls - logm), -1)
  assert cfg.kind == "topk_rkl"
  s = const["support"]
  inside = np.sum(np.where(s, ps * (ls - lt), 0.0), -1)
  tail_s, tail_t = np.sum(np.where(s, 0.0, ps), -1), np.sum(np.where(s, 0.0, pt), -1)
  has_tail = (~s).any(-1)
  safe_s, safe_t = np.where(has_tail, tail_s, 1.0), np.where(has_tail, tail_t, 1.0)
  return inside + np.where(has_tail, safe_s * (np.log(safe_s) - np.log(safe_t)), 0.0)


def ref_loss(zs, zt, y, mask, cfg, const):
  term = ref_term(zs, zt, y, cfg, const)
  return np.sum(mask * const["w"] * term) / max(mask.sum(), 1.0)




# --- the package's loss, reduced as in opdjax.training.step.opd_loss -----------------

def jax_loss(zs, zt, y, mask, rollout_lp, cfg):
  terms = per_token_terms(zs, zt, y, cfg)
  w = importance_weights(terms["trainer_logprobs"], rollout_lp, cfg)
  return masked_mean(w * terms["term"], mask)


def inputs(seed):
  rng = np.random.default_rng(seed)
  zs = rng.normal(0, 2, (B, T, V))
  zt = rng.normal(0, 2, (B, T, V))
  y = rng.integers(0, V, (B, T))
  # Rollout log-probs that put the IS weight exp(lp_s - lp_rollout) well below and
  # well above the threshold 2 (log 2 = 0.69), never near it.
  log_w = np.array([[-1.0, 1.5, 0.3], [1.2, -0.5, 0.2]])
  rollout_lp = pick(log_softmax(zs), y) - log_w
  return zs, zt, y, rollout_lp


CONFIGS = [LossConfig(kind=k) for k in OBJECTIVES if k not in ("topk_rkl", "jsd")] + [
    LossConfig(kind="sampled_rkl", is_correction="tis", is_threshold=IS_THRESHOLD),
    LossConfig(kind="sampled_rkl", is_correction="mis", is_threshold=IS_THRESHOLD),
    LossConfig(kind="topk_rkl", topk=3, topk_support="teacher"),
    LossConfig(kind="topk_rkl", topk=3, topk_support="student"),
    LossConfig(kind="jsd", jsd_beta=0.3),  # asymmetric beta: a swapped beta shows
]


def _id(c):
  return c.kind + ("" if c.is_correction == "none" else f"-{c.is_correction}") + (
      f"-{c.topk_support}" if c.kind == "topk_rkl" else "")


def test_every_objective_and_importance_mode_is_checked():
  assert {c.kind for c in CONFIGS} == set(OBJECTIVES)
  assert {c.is_correction for c in CONFIGS} == set(IS_MODES)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_value_and_gradient_match_float64_reference(cfg):
  zs, zt, y, rollout_lp = inputs(seed=CONFIGS.index(cfg))
  const = ref_constants(zs, zt, y, rollout_lp, cfg)
  want = ref_loss(zs, zt, y, MASK, cfg, const)
  want_grad = central_diff(lambda z: ref_loss(z, zt, y, MASK, cfg, const), zs)

  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  got, got_grad = jax.value_and_grad(jax_loss)(f32(zs), f32(zt), jnp.asarray(y), f32(MASK), f32(rollout_lp), cfg)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-7)
  assert_grads_close(got_grad, want_grad, rtol=1e-4, atol_frac=1e-4, min_scale=1e-2)
  assert np.all(np.asarray(got_grad)[MASK == 0] == 0)


SAMPLING = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)


def test_reference_processing_keeps_what_the_engine_keeps():
  z = np.array([[3.0, 2.9, 1.0, 0.5, 0.4, 0.0, -1.0]])
  lp = ref_sampling_logprobs(z, 0.5, 5, 0.9)
  kept = np.isfinite(lp)
  assert kept[0, :2].all() and not kept[0, 4:].any()  # the top-p cut falls inside the top 5
  np.testing.assert_allclose(np.exp(lp[kept]).sum(), 1.0)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_fused_loss_on_the_sampling_distribution_matches_float64_reference(cfg):
  """`fused_opd_loss` given the rollout's `sampling`: the objective is unchanged (T = 1); the IS
  weight compares the trainer's processed log-prob with the rollout's and is a constant factor."""
  zs, zt, _, _ = inputs(seed=20 + CONFIGS.index(cfg))
  proc = ref_sampling_logprobs(zs, SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p)
  # Targets the trainer's processed distribution keeps (the runner-up where kept, else the top
  # token), and one on-mask target it excludes: weight 0 under tis and mis.
  y = np.argsort(-zs, -1)[..., 1]
  y = np.where(np.isfinite(pick(proc, y)), y, np.argmax(zs, -1))
  y[0, 0] = np.argmin(zs[0, 0])
  trainer_lp = pick(proc, y)
  assert np.isfinite(trainer_lp[MASK > 0]).sum() == MASK.sum() - 1
  log_w = np.array([[-1.0, 1.5, 0.3], [1.2, -0.5, 0.2]])
  rollout_lp = np.where(np.isfinite(trainer_lp), trainer_lp - log_w, -2.0)
  const = ref_constants(zs, zt, y, rollout_lp, cfg, trainer_lp=trainer_lp)
  want = ref_loss(zs, zt, y, MASK, cfg, const)
  want_grad = central_diff(lambda z: ref_loss(z, zt, y, MASK, cfg, const), zs)

  eye, f32 = jnp.eye(V), functools.partial(jnp.asarray, dtype=jnp.float32)

  def loss(h, sampling):  # h @ I: the logits themselves are the differentiated input
    return fused_opd_loss(h, eye, f32(zt), eye, jnp.asarray(y), f32(rollout_lp), f32(MASK),
                          dataclasses.replace(cfg, chunk=2), jnp.float32, sampling)

  (got, terms), got_grad = jax.value_and_grad(loss, has_aux=True)(f32(zs), SAMPLING)
  np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-7)
  assert_grads_close(got_grad, want_grad, rtol=1e-4, atol_frac=1e-4, min_scale=1e-2)
  on = MASK > 0
  np.testing.assert_allclose(np.asarray(terms["trainer_logprobs"])[on], trainer_lp[on], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(terms["student_logprobs"])[on], pick(log_softmax(zs), y)[on], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(terms["is_weight"])[on], const["w"][on], rtol=1e-5, atol=1e-7)
  # Without IS weights the sampling changes nothing; with them it does (the comparison can fail).
  (plain, _), plain_grad = jax.value_and_grad(loss, has_aux=True)(f32(zs), None)
  if cfg.is_correction == "none":
    assert float(plain) == float(got)
    np.testing.assert_array_equal(plain_grad, got_grad)
  else:
    assert abs(float(plain) - float(got)) > 1e-3


@pytest.mark.parametrize("sampling,temperature,processes", [
    (None, 1.0, False),
    (SamplingParams(), 1.0, False),
    (SamplingParams(temperature=0.0, top_k=3), 1.0, False),  # greedy engines report the unscaled model
    (SamplingParams(temperature=0.0), 0.7, True),
    (SamplingParams(temperature=0.7), 1.0, True),
    (SamplingParams(temperature=0.7), 0.7, False),
    (SamplingParams(top_k=V), 1.0, False),  # a top-k of the whole vocabulary removes nothing
    (SamplingParams(top_k=V - 1), 1.0, True),
    (SamplingParams(temperature=0.7, top_p=0.9), 0.7, True),
])
def test_sampling_transform_runs_only_when_the_distribution_differs(sampling, temperature, processes):
  assert sampling_transform(sampling, V, temperature) is (sampling if processes else None)


def test_importance_modes_change_the_loss():
  zs, zt, y, rollout_lp = inputs(seed=7)
  losses = {mode: float(jax_loss(zs, zt, y, MASK, rollout_lp, LossConfig(
      kind="sampled_rkl", is_correction=mode, is_threshold=IS_THRESHOLD))) for mode in ("none", "tis", "mis")}
  assert len({round(v, 6) for v in losses.values()}) == 3, losses


@pytest.mark.parametrize("support", ["teacher", "student"])
def test_topk_rkl_with_one_tail_token_is_full_rkl(support):
  zs, zt, y, _ = inputs(seed=11)
  zs, zt = jnp.asarray(zs, jnp.float32), jnp.asarray(zt, jnp.float32)

  def f(cfg):
    loss = lambda z: masked_mean(per_token_terms(z, zt, y, cfg)["term"], MASK)
    return jax.value_and_grad(loss)(zs)

  full, full_grad = f(LossConfig(kind="full_rkl"))
  for k in (V - 1, V):  # a tail of one token (or none) loses nothing
    v, g = f(LossConfig(kind="topk_rkl", topk=k, topk_support=support))
    np.testing.assert_allclose(v, full, rtol=1e-6)
    np.testing.assert_allclose(g, full_grad, rtol=1e-5, atol=1e-7)
  # A tail of two or more tokens is a coarse-graining: KL can only shrink, and here it does.
  for k in (1, V - 2):
    cfg = LossConfig(kind="topk_rkl", topk=k, topk_support=support)
    per_pos = per_token_terms(zs, zt, y, cfg)["term"]
    exact = per_token_terms(zs, zt, y, LossConfig(kind="full_rkl"))["term"]
    assert np.all(np.asarray(per_pos) <= np.asarray(exact) + 1e-6)
    assert float(f(cfg)[0]) < float(full) - 1e-4


@pytest.mark.parametrize("kind", OBJECTIVES)
def test_masked_positions_change_nothing(kind):
  cfg = LossConfig(kind=kind, topk=3, is_correction="mis", is_threshold=IS_THRESHOLD)
  zs, zt, y, rollout_lp = inputs(seed=3)
  rng = np.random.default_rng(4)
  pad = MASK == 0
  zs2, zt2, y2, lp2 = zs.copy(), zt.copy(), y.copy(), rollout_lp.copy()
  zs2[pad] = rng.normal(0, 5, zs2[pad].shape)
  zt2[pad] = rng.normal(0, 5, zt2[pad].shape)
  y2[pad] = (y2[pad] + 1) % V
  lp2[pad] = -20.0
  grad = jax.value_and_grad(jax_loss)
  a, ga = grad(*[jnp.asarray(x, jnp.float32) for x in (zs, zt)], y, MASK, rollout_lp.astype(np.float32), cfg)
  b, gb = grad(*[jnp.asarray(x, jnp.float32) for x in (zs2, zt2)], y2, MASK, lp2.astype(np.float32), cfg)
  assert float(a) == float(b)
  np.testing.assert_array_equal(ga, gb)
  # ...while the same change at a real position does change the loss.
  zs2[0, 0] = zs2[0, 0][::-1]
  c = jax_loss(jnp.asarray(zs2, jnp.float32), zt2, y2, MASK, lp2.astype(np.float32), cfg)
  assert abs(float(c) - float(a)) > 1e-4


@pytest.mark.slow
def test_chunked_over_positions_is_chunk_size_independent():
  rng = np.random.default_rng(5)
  length, d = 7, 5
  h = jnp.asarray(rng.normal(size=(B, length, d)), jnp.float32)
  ht = jnp.asarray(rng.normal(size=(B, length, d)), jnp.float32)
  y = jnp.asarray(rng.integers(0, V, (B, length)))
  mask = jnp.asarray(rng.integers(0, 2, (B, length)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, V)), jnp.float32)
  cfg = LossConfig(kind="jsd", jsd_beta=0.3)

  def fn(h_c, ht_c, y_c, w):
    return per_token_terms(h_c @ w, ht_c @ (2 * w), y_c, cfg)

  def loss(w, h, chunk):
    if chunk is None:
      terms = fn(h, ht, y, w)
    else:
      terms = chunked_over_positions(lambda *xs: fn(*xs, w), chunk, h, ht, y)
    return masked_mean(terms["term"], mask) + masked_mean(terms["trainer_logprobs"], mask), terms

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  (ref, ref_terms), ref_grads = grad_fn(w, h, None)
  assert float(jnp.abs(ref_grads[0]).max()) > 1e-3
  for chunk in (1, 3, 64):  # 3 does not divide 7; 64 exceeds it
    (val, terms), grads = grad_fn(w, h, chunk)
    np.testing.assert_allclose(val, ref, rtol=1e-6)
    for k in ref_terms:
      assert terms[k].shape == (B, length)
      np.testing.assert_allclose(terms[k], ref_terms[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for g, rg in zip(grads, ref_grads, strict=True):
      np.testing.assert_allclose(g, rg, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_opd_loss_same_for_any_chunk(random_params):
  # IS weights on a full-distribution term: both the logits and the trainer log-probs go through chunks.
  cfg = LossConfig(kind="full_rkl", is_correction="tis", is_threshold=1.2)
  base = ModelConfig(model_type="qwen3", vocab_size=23, hidden_size=16, intermediate_size=24, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True)
  student, teacher = Model(base), Model(base.replace(hidden_size=24, num_heads=4))
  params, teacher_params = random_params(student, seed=0, std=0.3), random_params(teacher, seed=1, std=0.3)
  rng = np.random.default_rng(2)
  length = 6
  attn = np.ones((B, length), np.int32)
  attn[1, :2] = 0
  loss_mask = np.zeros((B, length), np.float32)
  loss_mask[:, 3:] = 1
  loss_mask[0, -1] = 0
  tokens = jnp.asarray(rng.integers(0, base.vocab_size, (B, length)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, base.vocab_size, (B, length)), jnp.int32)
  batch = {"tokens": tokens, "positions": positions_from_mask(attn), "attention_mask": jnp.asarray(attn),
           "targets": targets, "loss_mask": jnp.asarray(loss_mask),
           "rollout_logprobs": jnp.asarray(rng.uniform(-4, -2, (B, length)) * loss_mask, jnp.float32)}

  def run(chunk):  # gradients across chunk sizes: test_chunked_over_positions_is_chunk_size_independent
    f = functools.partial(opd_loss, student=student, teacher=teacher,
                          loss_cfg=dataclasses.replace(cfg, chunk=chunk))
    return jax.jit(f)(params, teacher_params, batch)

  one, m_one = run(1)
  full, m_full = run(length)
  assert float(one) > 1e-3 and float(m_one["num_tokens"]) == loss_mask.sum()
  assert 0 < float(m_one["is_weight_mean"]) < 1.2  # some weights are truncated
  np.testing.assert_allclose(one, full, rtol=1e-6)
  for k in m_one:
    np.testing.assert_allclose(m_one[k], m_full[k], rtol=1e-5, err_msg=k)

  # Unchunked path, straight from full logits: the same loss.
  @jax.jit
  def unchunked(params, teacher_params, batch):
    args = (batch["tokens"], batch["positions"], batch["attention_mask"])
    logits_s, _ = student.apply(params, *args)
    logits_t, _ = teacher.apply(teacher_params, *args)
    return jax_loss(logits_s, logits_t, batch["targets"], batch["loss_mask"], batch["rollout_logprobs"], cfg)

  np.testing.assert_allclose(unchunked(params, teacher_params, batch), one, rtol=1e-5)


@pytest.mark.parametrize("bad", [dict(kind="kl"), dict(is_correction="clip"), dict(topk_support="both"),
                                 dict(jsd_beta=0.0), dict(jsd_beta=1.0), dict(topk=0)])
def test_loss_config_rejects_bad_values(bad):
  field = next(iter(bad))
  with pytest.raises(UserError, match=f"loss.{field}"):  # a ValueError the CLI reports cleanly
    LossConfig(**bad)
  LossConfig(**{field: LossConfig.__dataclass_fields__[field].default})  # the default is accepted


def test_objectives_dispatch_through_the_registry_and_say_what_they_need():
  """Every objective is registered with what it needs from the teacher; the step's dispatch goes through the
  registry (an objective registered here is the one computed), an unregistered kind is refused at the config,
  and each teacher placement's refusal names what that placement feeds."""
  import opdjax.training.loss as L

  with pytest.raises(UserError, match="loss.kind='nope'; choose one of sampled_rkl"):
    LossConfig(kind="nope")
  assert set(L.OBJECTIVES) == {"sampled_rkl", "full_rkl", "topk_rkl", "forward_kl", "jsd"}
  from opdjax.config.schema import placement_refusal
  from opdjax.pipeline.teacher import placement_table

  assert L.fed_by(L.SERVER_ANSWER) == ["sampled_rkl", "topk_rkl"] and L.fed_by(L.FROM_LOGITS) == list(L.OBJECTIVES)
  assert not L.feeds(L.SERVER_ANSWER, LossConfig(kind="topk_rkl", topk_support="student"))
  assert "served by vLLM (teacher.serve=vllm) does not give; this placement feeds sampled_rkl, topk_rkl" in \
      placement_refusal("served", LossConfig(kind="jsd"))
  assert placement_refusal("engine", LossConfig(kind="jsd")) is None
  table = placement_table().splitlines()
  assert table[0].split() == ["objective", "trainer", "engine", "served"] and len(table) == 1 + 6
  import os

  page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "served_teacher.md")).read()
  assert f"```text\n{placement_table()}\n```" in page  # the docs' copy of the table is today's
  zs, zt = jnp.zeros((2, 3, 5)), jnp.ones((2, 3, 5))
  y = jnp.zeros((2, 3), jnp.int32)
  L.register(L.Objective("test_constant", lambda cfg: frozenset({L.SAMPLED}),
                         lambda logp_s, logp_t, lp_s, lp_t, rkl, m, cfg: jnp.full(lp_s.shape, 7.0)))
  try:
    cfg = LossConfig(kind="test_constant")
    np.testing.assert_array_equal(per_token_terms(zs, zt, y, cfg)["term"], 7.0)
    with pytest.raises(UserError, match="test_constant.*needs"):  # registered without a served term
      L.served_terms(zs, {"teacher_logprobs": jnp.zeros((2, 3))}, y, cfg)
    with pytest.raises(ValueError, match="registered twice"):
      L.register(L.OBJECTIVES["test_constant"])
  finally:
    del L.OBJECTIVES["test_constant"]
