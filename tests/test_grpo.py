"""GRPO baseline: advantages and loss gradient against float64 NumPy references, masking, learning."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_grads_close, log_softmax

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.rollout import Rollout
from opdjax.scoring.rescore import batch_from_rollout
from opdjax.training.grpo import (
  GrpoConfig,
  group_advantages,
  grpo_loss,
  make_grpo_step,
  repeat_prompts,
  repeat_references,
  verifier_rewards,
)
from opdjax.training.step import TrainState

pytestmark = pytest.mark.slow  # GRPO steps and rollouts compile per test: the full suite runs them


def _model(vocab=24, hidden=16):
  return Model(ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4))


def _rollout(rng, vocab, b=3, p=4, n=5):
  """Left-padded prompts, right-padded completions: row 0 full, row 1 ended early, row 2 has one token."""
  prompt_mask = np.ones((b, p), bool)
  prompt_mask[1, :2] = False
  prompt_mask[2, :1] = False
  completion_mask = np.ones((b, n), bool)
  completion_mask[1, 3:] = False
  completion_mask[2, 1:] = False
  return Rollout(prompt_tokens=jnp.asarray(rng.integers(3, vocab, (b, p)), jnp.int32),
                 prompt_mask=jnp.asarray(prompt_mask),
                 completion_tokens=jnp.asarray(rng.integers(3, vocab, (b, n)), jnp.int32),
                 completion_mask=jnp.asarray(completion_mask),
                 rollout_logprobs=jnp.asarray(rng.normal(-2.5, 0.5, (b, n)) * completion_mask, jnp.float32))


# --- advantages ------------------------------------------------------------------------------

def _ref_advantages(r, g, normalize_std, eps=1e-6):
  r = np.asarray(r, np.float64).reshape(-1, g)
  a = r - r.mean(1, keepdims=True)
  if normalize_std:
    a = a / (r.std(1, ddof=1, keepdims=True) + eps)
  return a.reshape(-1)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_match_numpy(normalize_std):
  # Groups of 3: a random group, a constant 0.1 group (in fp32 its mean rounds: 0.1 - mean != 0,
  # and / eps would blow that up), a 0/1 verifier group.
  r = np.concatenate([np.random.default_rng(0).normal(0, 2, 3), [0.1] * 3, [1.0, 0.0, 0.0]])
  got = np.asarray(group_advantages(r, 3, normalize_std=normalize_std))
  want = _ref_advantages(r, 3, normalize_std)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(got[3:6] == 0.0)  # the constant group: exactly 0
  assert np.abs(got[:3]).max() > 0.1
  np.testing.assert_allclose(got.reshape(3, 3).sum(1), 0.0, atol=1e-5)  # zero-mean within each group
  if normalize_std:
    np.testing.assert_allclose(got[:3].std(ddof=1), 1.0, rtol=1e-4)
    np.testing.assert_allclose(got[6:], [2 / np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3)], rtol=1e-5)
  else:
    np.testing.assert_allclose(got[6:], [2 / 3, -1 / 3, -1 / 3], rtol=1e-5)


def test_group_advantages_reject_bad_layouts():
  with pytest.raises(UserError, match="repeat_prompts"):
    group_advantages(np.zeros(10), 4)
  with pytest.raises(UserError, match="group_size"):
    group_advantages(np.zeros(4), 1)
  with pytest.raises(UserError):
    group_advantages(np.zeros((2, 4)), 4)


@pytest.mark.parametrize("kw", [{"group_size": 1}, {"group_size": 2.0}, {"is_correction": "clip"},
                                {"is_threshold": 0.0}, {"chunk": 0}, {"temperature": 0.0}])
def test_config_rejects_bad_values(kw):
  with pytest.raises(UserError, match=next(iter(kw))):
    GrpoConfig(**kw)


def test_repeat_layout_matches_group_advantages():
  prompts, pairs = [[1, 5, 6], [1, 7]], np.array([[12, 3], [40, 2]])
  rep, rep_pairs = repeat_prompts(prompts, 3), repeat_references(pairs, 3)
  assert rep == [[1, 5, 6]] * 3 + [[1, 7]] * 3
  assert rep_pairs.tolist() == [[12, 3]] * 3 + [[40, 2]] * 3
  assert repeat_references(["a", "b"], 2) == ["a", "a", "b", "b"]
  from opdjax.tasks.addition import AdditionTask
  task = AdditionTask()
  completions = [task.answer(12, 3), [3], task.answer(12, 3), task.answer(40, 2), [], [4]]
  r = verifier_rewards(task, rep_pairs, completions)
  assert r.tolist() == [1, 0, 1, 1, 0, 0]
  a = np.asarray(group_advantages(r, 3))
  assert a[0] > 0 > a[1] and a[3] > 0 > a[4]  # row i is in group i // 3


# --- the loss against a float64 reference ------------------------------------------------------

def _ref_loss_and_head_grad(h, w_head, targets, mask, rollout_lp, adv, cfg):
  """Float64 loss and d loss / d lm_head, written from the module docstring (hidden states fixed)."""
  logp = log_softmax(h @ w_head / cfg.temperature)
  lp = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  w = np.exp(lp - rollout_lp)
  if cfg.is_correction == "tis":
    w = np.minimum(w, cfg.is_threshold)
  elif cfg.is_correction == "mis":
    w = np.where(w <= cfg.is_threshold, w, 0.0)
  else:
    w = np.ones_like(w)
  n = max(mask.sum(), 1.0)
  loss = -np.sum(mask * w * adv[:, None] * lp) / n
  # d log p(y) / d logits = onehot(y) - softmax, and logits = h W / T.
  g_logits = np.eye(w_head.shape[1])[targets] - np.exp(logp)
  coef = -mask * w * adv[:, None] / (n * cfg.temperature)
  return loss, np.einsum("bld,blv->dv", h, coef[..., None] * g_logits), w


MODEL = _model()  # untied: lm_head is a plain [D, V] matrix the reference differentiates


def _cfg(mode):
  return GrpoConfig(group_size=2, is_correction=mode, is_threshold=2.0, chunk=4, temperature=0.7)


@jax.jit
def _value_and_grads(params, batch, adv):
  """`{mode: ((loss, metrics), grads)}` for the three importance modes: one compile for the tests below."""
  return {mode: jax.value_and_grad(lambda p, m=mode: grpo_loss(p, batch, adv, student=MODEL, cfg=_cfg(m)),
                                   has_aux=True)(params) for mode in ("none", "tis", "mis")}


@pytest.fixture(scope="module")
def setup(random_params):
  params = random_params(MODEL, seed=1, std=0.3)
  rng = np.random.default_rng(2)
  batch = batch_from_rollout(_rollout(rng, 24, b=4, p=4, n=6))
  mask = np.asarray(batch["loss_mask"], np.float64)
  h, _ = jax.jit(MODEL.hidden)(params, batch["tokens"], batch["positions"], batch["attention_mask"])
  h, w_head = np.asarray(h, np.float64), np.asarray(params["lm_head"]["kernel"], np.float64)
  lp = np.take_along_axis(log_softmax(h @ w_head / 0.7), np.asarray(batch["targets"])[..., None], -1)[..., 0]
  # Rollout log-probs that put each weight exp(lp - lp_rollout) well below or well above the
  # threshold 2 (log 2 = 0.69), never near it.
  log_w = rng.choice([-1.0, -0.3, 0.2, 1.2, 1.6], size=mask.shape)
  batch["rollout_logprobs"] = jnp.asarray((lp - log_w) * mask, jnp.float32)
  adv = np.array([1.3, -0.7, 0.9, -1.6])
  return params, batch, mask, h, w_head, log_w, adv


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_loss_and_gradient_match_float64_reference(setup, mode):
  params, batch, mask, h, w_head, log_w, adv = setup
  cfg = _cfg(mode)
  want, want_grad, want_w = _ref_loss_and_head_grad(h, w_head, np.asarray(batch["targets"]), mask, np.asarray(
      batch["rollout_logprobs"], np.float64), adv, cfg)
  (loss, m), grads = _value_and_grads(params, batch, jnp.asarray(adv, jnp.float32))[mode]
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)
  assert_grads_close(grads["lm_head"]["kernel"], want_grad, rtol=1e-3, atol_frac=1e-4, min_scale=1e-2)
  np.testing.assert_allclose(float(m["is_weight_mean"]), np.sum(mask * want_w) / mask.sum(), rtol=1e-4)
  high = (log_w > np.log(2.0)) & (mask > 0)
  assert 0 < high.sum() < mask.sum()  # the setting exercises truncation and zeroing
  np.testing.assert_allclose(float(m["is_clip_frac"]), 0.0 if mode == "none" else high.sum() / mask.sum(), atol=1e-6)
  assert float(m["num_tokens"]) == mask.sum()
  assert float(m["mismatch_abs_r_mean"]) > 0.3  # the injected mismatch shows in the metrics


def test_gradient_reaches_every_parameter(setup):
  """Central difference along the gradient (without IS the loss is a plain function of params):
  a gradient cut or mis-scaled in the decoder body, not only the head, shows here."""
  params, batch, _, _, _, _, adv = setup
  adv = jnp.asarray(adv, jnp.float32)
  grads = _value_and_grads(params, batch, adv)["none"][1]
  norm = float(optax.tree.norm(grads))
  body = float(optax.tree.norm({k: v for k, v in grads.items() if k != "lm_head"}))
  assert body > 0.1 * norm  # the decoder body gets a real share of the gradient
  t = 1e-2

  def loss_at(sign):
    p = jax.tree.map(lambda x, g: x + sign * t * g / norm, params, grads)
    return float(_value_and_grads(p, batch, adv)["none"][0][0])

  np.testing.assert_allclose((loss_at(1) - loss_at(-1)) / (2 * t), norm, rtol=1e-2)


def test_truncation_and_zeroing_change_the_gradient_the_right_way(setup):
  """Tokens over the threshold weigh w (none), C (tis) or 0 (mis); the others keep their weights."""
  params, batch, mask, _, _, log_w, adv = setup
  high = (log_w > np.log(2.0)) & (mask > 0)

  def head_grad(mode, m):
    b = {**batch, "loss_mask": jnp.asarray(m, jnp.float32)}
    g = _value_and_grads(params, b, jnp.asarray(adv, jnp.float32))[mode][1]
    return np.asarray(g["lm_head"]["kernel"], np.float64) * m.sum()  # undo the 1 / num_tokens

  low_only, high_only = mask * ~high, mask * high
  g_low_is = head_grad("tis", low_only)  # weights e^log_w < 2: TIS leaves them alone
  g_high_unit = head_grad("none", high_only)  # the high tokens with weight 1
  np.testing.assert_allclose(head_grad("mis", low_only), g_low_is, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(head_grad("mis", mask), g_low_is, rtol=1e-3, atol=1e-5)
  np.testing.assert_allclose(head_grad("tis", mask), g_low_is + 2.0 * g_high_unit, rtol=1e-3, atol=1e-5)
  assert np.abs(g_high_unit).max() > 0.1 * np.abs(g_low_is).max()  # the high tokens matter
  assert not np.allclose(head_grad("none", mask), head_grad("tis", mask), rtol=1e-2)


def test_padding_and_off_mask_entries_do_not_matter(setup):
  params, batch, _, _, _, _, adv = setup
  adv = jnp.asarray(adv, jnp.float32)

  def fn(p, b, a):
    return _value_and_grads(p, b, a)["tis"]

  (loss, m), grads = fn(params, batch, adv)

  # Other ids at padded prompt slots and past each completion's end (inputs and targets), and
  # rollout log-probs off the mask that would overflow exp() if they were read.
  rng = np.random.default_rng(5)
  off_attn, off = np.asarray(batch["attention_mask"]) == 0, np.asarray(batch["loss_mask"]) == 0
  changed = {**batch,
             "tokens": jnp.where(off_attn, rng.integers(3, 24, off.shape), batch["tokens"]),
             "targets": jnp.where(off, rng.integers(3, 24, off.shape), batch["targets"]),
             "rollout_logprobs": jnp.where(off, jnp.asarray(rng.choice([-1e4, 1e4], off.shape), jnp.float32),
                                           batch["rollout_logprobs"])}
  assert np.any(np.asarray(changed["tokens"] != batch["tokens"]))
  assert np.any(np.asarray(changed["targets"] != batch["targets"]))
  (loss2, m2), grads2 = fn(params, changed, adv)
  np.testing.assert_allclose(loss2, loss, rtol=1e-6)
  for k in m:
    assert np.isfinite(float(m2[k])), k
    np.testing.assert_allclose(m2[k], m[k], rtol=1e-5, atol=1e-7, err_msg=k)
  for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)

  # An on-mask change does move the loss: the comparison above can fail.
  i, j = np.argwhere(~off)[0]
  moved = {**batch, "targets": batch["targets"].at[i, j].set((batch["targets"][i, j] + 1) % 24)}
  assert abs(float(fn(params, moved, adv)[0][0]) - float(loss)) > 1e-4


def test_one_advantage_per_row_is_required(setup):
  params, batch, *_ = setup
  with pytest.raises(UserError, match="one advantage per row"):
    jax.eval_shape(lambda p: grpo_loss(p, batch, jnp.ones(2), student=MODEL, cfg=_cfg("none")), params)


# --- learning ------------------------------------------------------------------------------

def test_jitted_steps_raise_the_reward_skip_nonfinite_and_compile_once(random_params):
  """Reward 1 when the first completion token is TARGET: GRPO on the model's own samples learns it.

  The first step gets a NaN advantage: `skip_nonfinite` keeps the params and optimizer state.
  """
  from opdjax.rollout import JaxEngine, SamplingParams

  vocab, target, group = 12, 5, 8
  student = _model(vocab=vocab, hidden=16)
  cfg = GrpoConfig(group_size=group, is_correction="tis", chunk=8)
  opt = optax.adam(5e-2)
  step = make_grpo_step(student, cfg, opt, skip_nonfinite=True)
  state = TrainState.create(random_params(student, seed=0, std=0.02), opt)  # near-uniform next tokens
  engine = JaxEngine(student, state.params, max_len=16, pad_id=0, eos_ids=())
  rng = np.random.default_rng(0)
  prompts = repeat_prompts([list(rng.integers(1, vocab, 3)) for _ in range(8)], group)
  sampling = SamplingParams(max_new_tokens=2)

  before = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
  batch = batch_from_rollout(engine.generate(prompts, sampling, seed=100))
  state, m = step(state, batch, jnp.full((len(prompts),), jnp.nan, jnp.float32))
  assert float(m["skipped"]) == 1.0 and int(state.step) == 1
  for a, b in zip(jax.tree.leaves((state.params, state.opt_state)), before):
    np.testing.assert_array_equal(a, b)

  rewards, grad_norms = [], []
  for i in range(8):
    engine.sync(state.params, i)
    r = engine.generate(prompts, sampling, seed=i)
    reward = (np.asarray(r.completion_tokens[:, 0]) == target).astype(np.float32)
    old = state
    state, m = step(state, batch_from_rollout(r), group_advantages(reward, group))
    rewards.append(reward.mean())
    grad_norms.append(float(m["grad_norm"]))
    assert float(m["skipped"]) == 0.0
    assert abs(float(m["is_weight_mean"]) - 1.0) < 1e-4  # on-policy fp32: weights are 1
  # Measured: 0.08, 0.09, 0.23 -> 0.78, 0.91, 0.98 (a random model starts near 1 / vocab; other seeds alike).
  assert np.mean(rewards[:3]) < 0.3 and np.mean(rewards[-3:]) > 0.7, rewards
  assert np.isfinite(grad_norms).all() and max(grad_norms) > 0.1
  assert int(state.step) == 9
  assert step._cache_size() == 1  # jitted once
  assert jax.tree.leaves(old.params)[0].is_deleted()  # the state was donated


def test_rollout_scored_at_its_sampling_gives_unit_weights(random_params):
  """Engine and trainer hold the same weights, sampling at T = 0.7 with top-k and top-p: given the
  rollouts' `sampling`, the importance weights and mismatch metrics see no mismatch; scored at the
  temperature alone they see the top-k / top-p truncation. The objective is the same either way."""
  from opdjax.rollout import JaxEngine, SamplingParams

  vocab, group = 24, 4
  student = _model(vocab=vocab)
  params = random_params(student, seed=0, std=0.3)
  sampling = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=6, top_p=0.9)
  engine = JaxEngine(student, params, max_len=16, pad_id=0, eos_ids=())
  rng = np.random.default_rng(0)
  prompts = repeat_prompts([list(rng.integers(1, vocab, 3)) for _ in range(8)], group)
  batch = batch_from_rollout(engine.generate(prompts, sampling, seed=0))
  adv = jnp.asarray(rng.normal(size=len(prompts)), jnp.float32)
  opt = optax.sgd(1e-2)

  def run(sp, is_correction="tis"):
    cfg = GrpoConfig(group_size=group, is_correction=is_correction, chunk=4, temperature=sampling.temperature)
    state = TrainState.create(jax.tree.map(jnp.copy, params), opt)  # the step donates it
    state, m = make_grpo_step(student, cfg, opt, sampling=sp)(state, batch, adv)
    return state, {k: float(v) for k, v in m.items()}

  _, m = run(sampling)
  assert m["mismatch_kl_k3_tok"] < 1e-5 and m["mismatch_abs_r_max"] < 1e-4, m
  assert abs(m["is_weight_mean"] - 1.0) < 1e-4 and m["mismatch_excluded_frac"] == 0.0
  _, old = run(None)
  # The truncation gap; measured k3 0.053, is_weight_mean 0.73.
  assert old["mismatch_kl_k3_tok"] > 1e-2 and old["is_weight_mean"] < 0.95, old
  # Without IS weights the sampling reaches nothing: the same update.
  (a, ma), (b, mb) = run(sampling, "none"), run(None, "none")
  assert ma["loss"] == mb["loss"]
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_array_equal(x, y)
