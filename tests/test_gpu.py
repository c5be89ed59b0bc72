"""On a GPU: the bf16 OPD step and the engine run there and agree with fp32 re-scoring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.models import Model, ModelConfig
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.scoring.rescore import batch_from_rollout, token_logprobs
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig, TrainState, make_optimizer, make_train_step

pytestmark = pytest.mark.gpu


def _cfg(dtype):
  return ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)


def test_engine_on_gpu_matches_rescoring():
  model = Model(_cfg("float32"))
  params = jax.tree.map(lambda x: 3 * x, model.init(jax.random.key(0)))
  assert jax.tree.leaves(params)[0].devices().pop().platform == "gpu"
  with jax.default_matmul_precision("highest"):
    r = JaxEngine(model, params, max_len=64, pad_id=0, eos_ids=()).generate([[1, 2, 3]] * 8, SamplingParams(16))
    lp = token_logprobs(model, params, batch_from_rollout(r))
  assert float(jnp.max(jnp.abs(lp[:, -16:] - r.rollout_logprobs))) < 1e-3


def test_bf16_remat_step_on_gpu_learns():
  student, teacher = Model(_cfg("bfloat16"), remat_policy="full"), Model(_cfg("bfloat16"))
  opt = make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1))
  step = make_train_step(student, teacher, LossConfig(kind="full_rkl", chunk=32), opt)
  state = TrainState.create(student.init(jax.random.key(0)), opt)
  t_params = jax.tree.map(lambda x: 3 * x, teacher.init(jax.random.key(1)))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 4096, (4, 129)), jnp.int32)
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.broadcast_to(jnp.arange(128), (4, 128)),
           "attention_mask": jnp.ones((4, 128), bool), "loss_mask": jnp.ones((4, 128)),
           "rollout_logprobs": jnp.zeros((4, 128))}
  kls = []
  for _ in range(10):
    state, m = step(state, t_params, batch)
    kls.append(float(m["reverse_kl"]))
  assert np.isfinite(kls).all() and kls[-1] < kls[0]
