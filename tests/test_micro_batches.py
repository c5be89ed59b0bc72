"""train.micro_batches (issue 51, item 5): the step's gradient accumulated over micro-batches of its rows is the
unsplit step's, with the masked token normalisation of the whole batch, in one jitted, donated update."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from opdjax.config.defaults import default_config
from opdjax.config.schema import build
from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.training.loss import LossConfig
from opdjax.training.step import TrainState, make_train_step, opd_loss


def _cfg(hidden):
  return ModelConfig(model_type="qwen3", vocab_size=40, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=hidden // 4)


def _batch(rows=4, length=9):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 40, (rows, length + 1))
  mask = np.zeros((rows, length), np.float32)
  for r, end in enumerate((length, 4, length - 1, 6)[:rows]):  # rows of unequal lengths: unequal token counts
    mask[r, 2:end] = 1.0
  return {"tokens": jnp.asarray(tokens[:, :-1], jnp.int32), "positions": jnp.broadcast_to(jnp.arange(length),
          (rows, length)), "attention_mask": jnp.ones((rows, length), bool),
          "targets": jnp.asarray(tokens[:, 1:], jnp.int32), "loss_mask": jnp.asarray(mask),
          "rollout_logprobs": jnp.asarray(rng.normal(-3.0, 0.5, (rows, length)), jnp.float32)}


def _step(loss_cfg, micro_batches, student, teacher, params, t_params, batch):
  step = make_train_step(student, teacher, loss_cfg, optax.sgd(0.5), micro_batches=micro_batches)
  state = TrainState.create(jax.tree.map(jnp.copy, params), optax.sgd(0.5))
  new, metrics = step(state, t_params, batch)
  assert step._cache_size() == 1 and jax.tree.leaves(state.params)[0].is_deleted()  # jitted once, donated
  return new.params, metrics


@pytest.mark.slow  # compiles the step three times per objective (about 15 s on 2 cores)
@pytest.mark.parametrize("loss_cfg", [LossConfig(kind="full_rkl", chunk=4),
                                      LossConfig(kind="sampled_rkl", chunk=4, is_correction="tis")])
def test_micro_batches_equal_the_unsplit_step(loss_cfg):
  student, teacher = Model(_cfg(16)), Model(_cfg(32))
  params, t_params = student.init(jax.random.key(0)), teacher.init(jax.random.key(1))
  batch = _batch()
  # The micro-batches (rows 0, 2 and rows 1, 3) hold 12 and 6 tokens: a plain mean of their losses would differ.
  assert float(batch["loss_mask"][0::2].sum()) != float(batch["loss_mask"][1::2].sum())
  whole, m1 = _step(loss_cfg, 1, student, teacher, params, t_params, batch)
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(params))) > 1e-3
  for k in (2, 4):  # 4: micro-batches of one row
    split, mk = _step(loss_cfg, k, student, teacher, params, t_params, batch)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert set(mk) == set(m1)
    for key in m1:  # every metric is the whole batch's, not a mean of the micro-batches'
      np.testing.assert_allclose(mk[key], m1[key], rtol=2e-5, atol=2e-6, err_msg=f"{key} with {k} micro-batches")


@pytest.mark.slow  # compiles two steps and a reference gradient (about 10 s on 2 cores)
def test_loo_baseline_averages_within_each_micro_batch():
  """loss.baseline='loo' needs the other rows at the same position. With micro-batches it takes the other rows of
  its own micro-batch (still independent of the row's own sample, so unbiased): the step equals the token-weighted
  sum of each micro-batch's own unsplit gradient, and differs from the whole batch's leave-one-out."""
  loss_cfg = LossConfig(kind="sampled_rkl", baseline="loo", chunk=4)
  student, teacher = Model(_cfg(16)), Model(_cfg(32))
  params, t_params = student.init(jax.random.key(0)), teacher.init(jax.random.key(1))
  batch = _batch()
  whole, _ = _step(loss_cfg, 1, student, teacher, params, t_params, batch)
  split, _ = _step(loss_cfg, 2, student, teacher, params, t_params, batch)
  grad = jax.grad(lambda p, b: opd_loss(p, t_params, b, student=student, teacher=teacher, loss_cfg=loss_cfg)[0])
  total = float(batch["loss_mask"].sum())
  ref = None
  for rows in (slice(0, None, 2), slice(1, None, 2)):  # micro-batch j holds rows j, j + k, ...
    micro = jax.tree.map(lambda x, rows=rows: x[rows], batch)
    g = jax.tree.map(functools.partial(jnp.multiply, float(micro["loss_mask"].sum()) / total), grad(params, micro))
    ref = g if ref is None else jax.tree.map(jnp.add, ref, g)
  for a, p, g in zip(jax.tree.leaves(split), jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, p - 0.5 * g, rtol=2e-5, atol=2e-6)
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split))) > 1e-5


def test_micro_batches_config_checks():
  cfg = default_config()
  cfg.rollout.batch_size = 6
  cfg.train.micro_batches = 4
  with pytest.raises(UserError, match="train.micro_batches=4 does not divide rollout.batch_size=6"):
    build(cfg)
  cfg.train.micro_batches, cfg.loss.kind, cfg.loss.baseline = 6, "sampled_rkl", "loo"
  with pytest.raises(UserError, match="leaves 1 row in each: give train.micro_batches <= 3"):
    build(cfg)
  cfg.train.micro_batches = 3
  assert build(cfg).train.micro_batches == 3
