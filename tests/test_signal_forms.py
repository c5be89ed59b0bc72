"""`sampled_rkl`'s forms against a float64 reference, value and gradient, through the fused loss the trainer runs:
where the advantage's student log-prob comes from (`loss.student_logprobs`: the trainer's re-scoring, or the
engine's reported q(y)), the student's half sampled or exact, the leave-one-out baseline or none, and every
`loss.is_correction`. The reference is written from opdjax/training/loss.py's docstring."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, central_diff, log_softmax

from opdjax.config.defaults import default_config
from opdjax.config.loader import ConfigError, apply_overrides
from opdjax.config.schema import build
from opdjax.errors import UserError
from opdjax.training.fused import fused_opd_loss, fused_served_loss
from opdjax.training.loss import BASELINES, IS_MODES, STUDENT_LOGPROBS, LossConfig

B, T, V = 3, 3, 6
MASK = np.array([[1, 1, 0], [1, 0, 1], [1, 1, 1]], np.float32)
FORMS = [(s, t) for s in STUDENT_LOGPROBS for t in ("sampled", "exact") if not (s == "rollout" and t == "exact")]
CONFIGS = [LossConfig(kind="sampled_rkl", student_logprobs=s, student_term=t, baseline=b, is_correction=i,
                      is_threshold=2.0, chunk=2) for s, t in FORMS for b in BASELINES for i in IS_MODES]


def _id(c):
  return f"{c.student_logprobs}-{c.student_term}-{c.baseline}-{c.is_correction}"


def pick(x, y):
  return np.take_along_axis(x, y[..., None], axis=-1)[..., 0]


def inputs(seed):
  rng = np.random.default_rng(seed)
  zs, zt = rng.normal(0, 2, (B, T, V)), rng.normal(0, 2, (B, T, V))
  y = rng.integers(0, V, (B, T))
  # The engine's q(y) off the trainer's by log-ratios well below and above log 2 (the IS threshold), never near it.
  log_w = np.array([[-1.0, 1.5, 0.3], [1.2, -0.5, 0.2], [0.9, -1.3, 1.1]])
  return zs, zt, y, pick(log_softmax(zs), y) - log_w


def ref_loss(zs, zs0, zt, y, q, cfg):
  """float64: sum(m w term) / max(sum m, 1), what the loss holds constant evaluated at the base logits zs0."""
  ls, ls0, lt = log_softmax(zs), log_softmax(zs0), log_softmax(zt)
  own = q if cfg.student_logprobs == "rollout" else pick(ls0, y)
  a = pick(lt, y) - (0.0 if cfg.student_term == "exact" else own)
  if cfg.baseline == "loo":  # the other rows' masked mean at the same position
    total, count = np.sum(MASK * a, 0), np.sum(MASK, 0)
    a = a - (total - MASK * a) / np.maximum(count - MASK, 1.0)
  term = -a * pick(ls, y)
  if cfg.student_term == "exact":
    term = term + np.sum(np.exp(ls) * ls, -1)
  w = np.exp(pick(ls0, y) - q)
  w = {"none": np.ones_like(w), "tis": np.minimum(w, cfg.is_threshold),
       "mis": np.where(w <= cfg.is_threshold, w, 0.0)}[cfg.is_correction]
  return np.sum(MASK * w * term) / max(MASK.sum(), 1.0)




f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
EYE = jnp.eye(V)  # h @ I: the logits themselves are the differentiated input


def fused(zs, zt, y, q, cfg, served=False):
  if served:  # a served teacher's answer: the sampled token's log-prob only
    teacher = {"teacher_logprobs": f32(pick(log_softmax(zt), y))}
    return fused_served_loss(zs, EYE, teacher, jnp.asarray(y), f32(q), f32(MASK), cfg, jnp.float32)
  return fused_opd_loss(zs, EYE, f32(zt), EYE, jnp.asarray(y), f32(q), f32(MASK), cfg, jnp.float32)


def test_every_form_baseline_and_importance_mode_is_checked():
  assert {(c.student_logprobs, c.student_term) for c in CONFIGS} == {("trainer", "sampled"), ("trainer", "exact"),
                                                                    ("rollout", "sampled")}
  assert {c.is_correction for c in CONFIGS} == set(IS_MODES) and {c.baseline for c in CONFIGS} == set(BASELINES)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_value_and_gradient_match_float64_reference(cfg):
  zs, zt, y, q = inputs(seed=CONFIGS.index(cfg))
  want = ref_loss(zs, zs, zt, y, q, cfg)
  want_grad = central_diff(lambda z: ref_loss(z, zs, zt, y, q, cfg), zs)
  (got, terms), got_grad = jax.value_and_grad(lambda z: fused(z, zt, y, q, cfg), has_aux=True)(f32(zs))
  np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-7)
  assert_grads_close(got_grad, want_grad, rtol=1e-4, atol_frac=1e-4, min_scale=1e-2)
  assert np.all(np.asarray(got_grad)[MASK == 0] == 0)
  if cfg.student_term == "sampled":  # the served teacher's path gives the same (it needs only log p_t(y))
    (served, _), served_grad = jax.value_and_grad(lambda z: fused(z, zt, y, q, cfg, True), has_aux=True)(f32(zs))
    np.testing.assert_allclose(float(served), want, rtol=1e-5, atol=1e-7)
    assert_grads_close(served_grad, want_grad, rtol=1e-4, atol_frac=1e-4, min_scale=1e-2)


@pytest.mark.parametrize("baseline", BASELINES)
def test_the_engine_form_differs_from_the_trainer_form_exactly_by_the_engines_error(baseline):
  """The comparison above can fail: with q != the trainer's log-prob the two forms differ; with q equal to it
  (an engine without mismatch) they agree bit for bit in value and gradient."""
  zs, zt, y, q = inputs(seed=99)
  cfgs = {s: LossConfig(kind="sampled_rkl", student_logprobs=s, baseline=baseline, chunk=2) for s in STUDENT_LOGPROBS}
  grad = {s: jax.grad(lambda z, c=c: fused(z, zt, y, q, c)[0])(f32(zs)) for s, c in cfgs.items()}
  assert float(jnp.max(jnp.abs(grad["rollout"] - grad["trainer"]))) > 1e-2
  exact_q = np.asarray(fused(f32(zs), zt, y, q, cfgs["trainer"])[1]["student_logprobs"])
  same = {s: jax.value_and_grad(lambda z, c=c: fused(z, zt, y, exact_q, c)[0])(f32(zs)) for s, c in cfgs.items()}
  assert float(same["rollout"][0]) == float(same["trainer"][0])
  np.testing.assert_array_equal(same["rollout"][1], same["trainer"][1])


@pytest.mark.parametrize("changes", [dict(kind="full_rkl"), dict(kind="topk_rkl"), dict(student_term="exact")])
def test_the_engine_form_is_refused_where_the_objective_has_no_student_log_prob(changes):
  with pytest.raises(UserError, match="student_logprobs='rollout'.*use loss.kind='sampled_rkl'"):
    LossConfig(**{"kind": "sampled_rkl", "student_logprobs": "rollout", **changes})
  with pytest.raises(UserError, match="choose one of trainer, rollout"):
    LossConfig(kind="sampled_rkl", student_logprobs="engine")


@pytest.mark.parametrize("sampling", [{"rollout.temperature": "0.7"}, {"rollout.top_k": "3"}, {"rollout.top_p": "0.9"}])
def test_the_engine_form_is_refused_where_the_engine_samples_another_distribution(sampling):
  over = {"loss.kind": "sampled_rkl", "loss.student_logprobs": "rollout"}
  assert build(apply_overrides(default_config(), over)).loss.student_logprobs == "rollout"
  with pytest.raises((UserError, ConfigError), match="set rollout.temperature=1, top_k=0, top_p=1"):
    build(apply_overrides(default_config(), {**over, **sampling}))


@pytest.mark.slow
def test_the_form_is_recorded_in_the_step_metrics_and_the_config(random_params):
  """`opd_signal` (per step) is the signal the advantage used: the engine's with the engine form, the trainer's
  otherwise; config.json records loss.student_logprobs."""
  from opdjax.models import Model, ModelConfig, positions_from_mask
  from opdjax.training.step import opd_loss

  base = ModelConfig(model_type="qwen3", vocab_size=11, hidden_size=16, intermediate_size=24, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True)
  student = Model(base)
  params, teacher_params = random_params(student, seed=0, std=0.3), random_params(student, seed=1, std=0.3)
  rng, length = np.random.default_rng(3), 5
  mask = np.ones((2, length), np.float32)
  batch = {"tokens": jnp.asarray(rng.integers(0, 11, (2, length)), jnp.int32), "loss_mask": jnp.asarray(mask),
           "positions": positions_from_mask(np.ones((2, length), np.int32)), "attention_mask": jnp.ones((2, length)),
           "targets": jnp.asarray(rng.integers(0, 11, (2, length)), jnp.int32),
           "rollout_logprobs": jnp.asarray(rng.uniform(-4, -2, (2, length)), jnp.float32)}
  metrics = {}
  for form in STUDENT_LOGPROBS:
    cfg = LossConfig(kind="sampled_rkl", student_logprobs=form, chunk=2)
    _, metrics[form] = opd_loss(params, teacher_params, batch, student=student, teacher=student, loss_cfg=cfg)
  assert float(metrics["trainer"]["opd_signal"]) == float(metrics["trainer"]["opd_signal_trainer"])
  assert float(metrics["rollout"]["opd_signal"]) == float(metrics["rollout"]["opd_signal_rollout"])
  assert abs(float(metrics["rollout"]["opd_signal"]) - float(metrics["trainer"]["opd_signal"])) > 1e-3
  cfg = build(apply_overrides(default_config(), {"loss.kind": "sampled_rkl", "loss.student_logprobs": "rollout"}))
  assert cfg.to_dict()["loss"]["student_logprobs"] == "rollout"
