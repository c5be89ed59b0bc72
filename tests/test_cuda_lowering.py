"""The GPU attention paths, checked on this CPU: programs lowered for CUDA (`lowering_platforms`) with a
GPU and cuDNN 9.10 stood in, at the real shapes of `configs/qwen3_1p7b_to_0p6b.py`, contain cuDNN's
fused attention and no fallback; what cuDNN refuses (at trace or at compile time) falls back to XLA."""

import logging
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo

from opdjax.analyses.capacity import load_model_config
from opdjax.models import Model, ModelConfig, attention
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.rollout.jax.engine import install_params
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig, TrainState, make_optimizer, make_train_step

# configs/qwen3_1p7b_to_0p6b.py: rollout.max_len 1024 (so L = P + N - 1 = 1023), batch 64, sampled_rkl, chunk 128.
MAX_LEN, BATCH = 1024, 64
FWD, BWD = "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"
FWD_NO_BIAS, BWD_NO_BIAS = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"


@pytest.fixture
def cuda(monkeypatch, caplog):
  """A stand-in GPU with cuDNN 9.10 for tracing; returns the attention notices logged."""
  monkeypatch.setattr(attention, "_platform", lambda: "gpu")
  monkeypatch.setattr(attention, "_noticed", set())
  monkeypatch.setattr(attention, "_cudnn_verdicts", {})
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
  caplog.set_level(logging.WARNING, logger=attention.__name__)
  return lambda: [r.getMessage() for r in caplog.records if r.name == attention.__name__]


def _calls(text: str) -> list[str]:
  return re.findall(r"custom_call @([\w.$-]+)", text)


def _qwen3(name: str, **kw) -> ModelConfig:
  return load_model_config(name)[1].replace(dtype="bfloat16", **kw)


def _train_step_text(length: int, padded: bool = True) -> str:
  student = Model(_qwen3("qwen3-0.6b"), remat_policy="full")
  teacher = Model(_qwen3("qwen3-1.7b"))
  opt = make_optimizer(OptimConfig())
  step = make_train_step(student, teacher, LossConfig(kind="sampled_rkl", chunk=128), opt)
  state = jax.eval_shape(lambda: TrainState.create(student.init(jax.random.key(0)), opt))
  t_params = jax.eval_shape(teacher.init, jax.random.key(1))
  i32, f32 = (jax.ShapeDtypeStruct((BATCH, length), d) for d in (jnp.int32, jnp.float32))
  batch = {"tokens": i32, "targets": i32, "positions": i32, "loss_mask": f32, "rollout_logprobs": f32,
           "attention_mask": jax.ShapeDtypeStruct((BATCH, length), jnp.int32) if padded else None}
  return step.trace(state, t_params, batch).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("padded", [True, False])
def test_train_step_at_the_config_shapes_lowers_to_cudnn_without_a_bias(cuda, padded):
  """Every layer of both models, forward and backward, through cuDNN with no fallback and no
  [B, 1, T, T] bias for it to read (nor its gradient to write): a padded batch's rows are left-aligned
  and attend under causality alone, as an unpadded batch (attention_mask None) does. L = 1023 is odd,
  and cuDNN's backward takes only even lengths: one position is padded rather than falling back."""
  text = _train_step_text(MAX_LEN - 1, padded=padded)
  calls = _calls(text)
  assert calls.count(FWD_NO_BIAS) >= 2 and calls.count(BWD_NO_BIAS) >= 1, sorted(set(calls))
  assert FWD not in calls and BWD not in calls, sorted(set(calls))
  assert f"tensor<{BATCH}x1x{MAX_LEN}x{MAX_LEN}x" not in text  # no bias, even at the evened length
  assert cuda() == []  # no fallback notice


@pytest.mark.slow  # 24 s in the fast tier on 2 cores (lowers and runs the attention both ways)
def test_left_aligned_rows_attend_as_the_key_mask_did(monkeypatch):
  """The decoder's left-aligned, mask-free attention (what cuDNN runs) against the masked attention
  (XLA's, the CPU default), on rows padded on the left, on both sides and not at all: the same logits
  at every real position and the same parameter gradients of a loss over them. Dropping the mask
  without aligning the rows changes the padded rows' logits (what the comparison could catch)."""
  from opdjax.models import decoder

  model = Model(ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True))
  params = model.init(jax.random.key(0))
  rng = jax.random.split(jax.random.key(1), 2)
  ids = jnp.arange(9)[None, :]
  mask = (ids >= jnp.asarray([[0], [3], [5]])) & (ids < jnp.asarray([[9], [7], [9]]))
  tokens = jnp.where(mask, jax.random.randint(rng[0], (3, 9), 1, 64), 0)
  positions = decoder.positions_from_mask(mask)
  weights = jnp.where(mask[..., None], jax.random.normal(rng[1], (3, 9, 64)), 0.0)

  def run(aligned, attention_mask=mask):
    monkeypatch.setattr(decoder, "drops_key_mask", lambda cfg: aligned)
    def loss(p):
      logits, _ = model.apply(p, tokens, positions, attention_mask)
      return jnp.sum(weights * logits), logits
    return jax.value_and_grad(loss, has_aux=True)(params)

  (_, want), want_g = run(False)
  (_, got), got_g = run(True)
  (_, unaligned), _ = run(False, attention_mask=None)
  real, scale = mask[..., None], float(jnp.max(jnp.abs(want)))
  assert float(jnp.max(jnp.abs(jnp.where(real, got - want, 0)))) < 1e-5 * scale
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    assert float(jnp.max(jnp.abs(a - b))) < 1e-5 * (1 + float(jnp.max(jnp.abs(b)))), a.shape
  assert float(jnp.max(jnp.abs(jnp.where(real, unaligned - want, 0)))) > 1e-2 * scale


def _generate_text(prompt: int, new: int, batch: int = 8) -> str:
  model = Model(_qwen3("qwen3-0.6b"))
  engine = JaxEngine(model, None, max_len=prompt + new, pad_id=0, eos_ids=())
  fn = engine._fn(SamplingParams(max_new_tokens=new, temperature=1.0))
  params = jax.eval_shape(lambda: install_params(model.init(jax.random.key(0)), model))
  cache = jax.eval_shape(lambda: model.init_cache(batch, prompt + new))
  tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
  return fn.trace(params, cache, tokens, jax.ShapeDtypeStruct((batch, prompt), bool),
                  jax.eval_shape(lambda: jax.random.key(0))).lower(lowering_platforms=("cuda",)).as_text()


# (prompt, new tokens, batch): an odd cache, and the config's rollout (max_new_tokens 512 of max_len 1024,
# the longest prompt padded to 512, batch 64).
@pytest.mark.parametrize("prompt,new,batch", [(120, 129, 8), (MAX_LEN - 512, 512, BATCH)])
def test_the_rollouts_prefill_lowers_to_cudnn(cuda, prompt, new, batch):
  """A prefill is never differentiated: p=120 (odd) takes cuDNN's forward in each of the 28 layers (the
  training-only even-length rule once sent it to XLA). The decode steps read the cache through
  `decode_attention` (plain XLA dots, no custom call) and log no fallback."""
  calls = _calls(_generate_text(prompt, new, batch))
  assert calls.count(FWD) == _qwen3("qwen3-0.6b").num_layers and BWD not in calls, sorted(set(calls))
  assert cuda() == []


def test_a_cudnn_graph_that_fails_to_compile_falls_back_to_xla(cuda, monkeypatch):
  """A cuDNN graph-build error shows only when XLA compiles the call: the check compiles it on its
  own first, and a failure there is a fallback with one notice, not a crash of the step's compile."""
  def fails(fn, abstract):
    raise RuntimeError("INTERNAL: cuDNN graph build failed (stand-in)")
  monkeypatch.setattr(attention, "_compile_check", fails)
  model = Model(ModelConfig(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=32, dtype="bfloat16"))
  params = jax.eval_shape(model.init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  text = jax.jit(model.apply).trace(params, x, x, x).lower(lowering_platforms=("cuda",)).as_text()
  assert not [c for c in _calls(text) if "cudnn" in c]
  notes = [n for n in cuda() if "q (2, 16, 2, 32)" in n]  # model.init traced its own (1, 2) call
  assert len(notes) == 1 and "graph build failed" in notes[0] and "XLA" in notes[0], cuda()


@pytest.mark.slow  # 13 s a case in the fast tier on 2 cores
@pytest.mark.parametrize("masked", [True, False])
def test_the_even_padding_changes_neither_the_output_nor_its_gradient(masked):
  """What cuDNN gets at odd lengths (one key and one query more), run through XLA here: the sliced
  output and the q/k/v gradients equal the unpadded attention's."""
  rng = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(rng[0], (2, 7, 4, 8))
  k, v = (jax.random.normal(r, (2, 7, 2, 8)) for r in rng[1:])
  keys = jnp.arange(7)[None, :] >= jnp.asarray([[0], [3]])  # row 1 left-padded by 3
  mask = jnp.broadcast_to(keys[:, None, None, :], (2, 1, 7, 7)) if masked else None

  def run(pad):
    def f(q, k, v):
      a, b, c, m = attention._even(q, k, v, mask) if pad else (q, k, v, mask)
      out = jax.nn.dot_product_attention(a, b, c, mask=m, is_causal=True)[:, :7]
      return jnp.sum(jnp.where(keys[..., None, None], out, 0) ** 2), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, want), want_g = run(False)
  (_, got), got_g = run(True)
  assert attention._even(q, k, v, mask)[0].shape[1] == 8
  real = keys[..., None, None]
  assert float(jnp.max(jnp.abs(jnp.where(real, got - want, 0)))) < 1e-5
  for a, b in zip(got_g, want_g, strict=True):
    assert float(jnp.max(jnp.abs(a - b))) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp32_compute_multiplies_at_highest_precision(dtype):
  """On a GPU XLA's default runs fp32 dots as TF32: fp32 re-scoring, the train step (its loss's
  vocab projections included, forward and backward) and the engine's decode all ask for HIGHEST;
  bf16 compute keeps the default (its dots are bf16 anyway)."""
  from opdjax.scoring.rescore import token_logprobs

  cfg = ModelConfig(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, dtype=dtype)
  student, teacher = Model(cfg), Model(cfg.replace(hidden_size=48))
  opt = make_optimizer(OptimConfig())
  step = make_train_step(student, teacher, LossConfig(kind="full_rkl", chunk=8), opt)
  state = jax.eval_shape(lambda: TrainState.create(student.init(jax.random.key(0)), opt))
  t_params = jax.eval_shape(teacher.init, jax.random.key(1))
  i32, f32 = (jax.ShapeDtypeStruct((2, 16), d) for d in (jnp.int32, jnp.float32))
  batch = {"tokens": i32, "targets": i32, "positions": i32, "loss_mask": f32, "rollout_logprobs": f32,
           "attention_mask": i32}
  engine = JaxEngine(student, None, max_len=32, pad_id=0, eos_ids=())
  generate = engine._fn(SamplingParams(max_new_tokens=8, temperature=1.0))
  texts = {
      "train step": step.trace(state, t_params, batch).lower(lowering_platforms=("cuda",)).as_text(),
      "scoring": jax.jit(lambda p, b: token_logprobs(student, p, b)).trace(state.params, batch).lower(
          lowering_platforms=("cuda",)).as_text(),
      "generate": generate.trace(jax.eval_shape(lambda p: install_params(p, student), state.params),
                                 jax.eval_shape(lambda: student.init_cache(2, 16)),
                                 jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2, 8), bool),
                                 jax.eval_shape(lambda: jax.random.key(0))).lower(
                                     lowering_platforms=("cuda",)).as_text(),
  }
  for what, text in texts.items():
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    highest = [line for line in dots if "precision = [HIGHEST, HIGHEST]" in line]
    assert len(dots) > 4, what
    assert len(highest) == (len(dots) if dtype == "float32" else 0), (what, len(highest), len(dots))
