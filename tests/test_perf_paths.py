"""The performance paths, checked on CPU: fused attention and the cached decode against the einsum they
replaced, real FP8 matmuls (exported for CUDA), no teacher vocab projection recomputed in the train
step, and export of the default paths for CUDA and TPU. The engine's decode step itself (its HLO, the
fp8 cache, W8A16) is tests/test_decode_engine.py."""

import functools
import logging
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig, UnsupportedModelError, attention, kv_cache, quant
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.rollout.jax.engine import decode_step, install_params
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig, TrainState, make_optimizer, train_step
from opdjax.views import perturb


def _cfg(**kw):
  # GQA (4 query heads over 2 kv heads); vocab 96 differs from every other matrix dimension, so a
  # dot with a [D, V] operand is a vocab projection.
  base = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8)
  return ModelConfig(**{**base, **kw})


def _padded(rng, b=3, t=9, vocab=96):
  """Row 0 full, row 1 left-padded by 3, row 2 by 5; RoPE positions from each row's first real token."""
  tokens = rng.integers(3, vocab, (b, t)).astype(np.int32)
  mask = np.ones((b, t), np.int32)
  mask[1, :3] = 0
  mask[2, :5] = 0
  return tokens, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)


# --- the einsum attention every path replaced, kept here as the reference -------------------------

def einsum_attention(q_BxTxHxE, keys_BxSxKxE, values_BxSxKxE, mask_BxTxS):
  b, t, h, e = q_BxTxHxE.shape
  k = keys_BxSxKxE.shape[2]
  scores = jnp.einsum("btkge,bske->bkgts", q_BxTxHxE.reshape(b, t, k, h // k, e), keys_BxSxKxE,
                      preferred_element_type=jnp.float32) * (e ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_BxTxHxE.dtype)
  return jnp.einsum("bkgts,bske->btkge", probs, values_BxSxKxE).reshape(b, t, h, e)


@pytest.fixture
def einsum_reference(monkeypatch):
  """Makes the decoder attend with `einsum_attention`, with a cache over the whole cache under the
  slot mask (the path before fused attention and the per-layer cache) for the rest of the test."""
  def fused(q, k, v, mask_Bx1xTxS, is_causal, impl, training=True):
    mask = mask_Bx1xTxS[:, 0]
    if is_causal:
      mask = mask & jnp.tril(jnp.ones(mask.shape[-2:], bool))
    return einsum_attention(q, k, v, mask)

  def whole_cache(q_BxTxKxGxE, layer, start_B, index, dtype, cfg):
    b, t, k, g, e = q_BxTxKxGxE.shape
    keys, values = (jnp.swapaxes(kv_cache.read(layer, n, dtype, cfg), 1, 2) for n in ("k", "v"))
    slot = jnp.arange(keys.shape[1])
    mask = (slot[None, None, :] <= (index + jnp.arange(t))[None, :, None]) & (slot >= start_B[:, None])[:, None, :]
    return einsum_attention(q_BxTxKxGxE.reshape(b, t, k * g, e), keys, values, mask).reshape(b, t, k, g, e)

  def use():
    monkeypatch.setattr(attention, "fused_attention", fused)
    monkeypatch.setattr(kv_cache, "attention", whole_cache)

  return use


def _run(fn, *args):
  return jax.jit(lambda *a: fn(*a))(*args)  # a fresh function: never a trace cached before a patch


def _prefill_then_decode(model, params, tokens, mask, positions, prefill, slots, cache=None):
  """Logits `[B, T, V]` of a prefill of `prefill` tokens and one decode step per later token."""
  b, t = tokens.shape
  kv_mask = np.zeros((b, slots), np.int32)
  kv_mask[:, :prefill] = mask[:, :prefill]
  cache = model.init_cache(b, slots) if cache is None else cache
  logits, cache = _run(model.apply, params, tokens[:, :prefill], positions[:, :prefill], kv_mask, cache)
  steps = [np.asarray(logits)]
  step = jax.jit(model.apply)
  for i in range(prefill, t):
    kv_mask[:, i] = mask[:, i]
    logits, cache = step(params, tokens[:, i:i + 1], positions[:, i:i + 1], kv_mask, cache)
    steps.append(np.asarray(logits))
  return np.concatenate(steps, axis=1)


@pytest.mark.slow
def test_fused_attention_matches_the_einsum_path(random_params, einsum_reference):
  """fp32, GQA, left padding: a full forward and a prefill + decode with a 13-slot cache equal the
  einsum over the whole cache."""
  model = Model(_cfg())
  params = random_params(model, seed=0, std=0.4)
  tokens, mask, positions = _padded(np.random.default_rng(0))
  real = mask.astype(bool)
  full = np.asarray(_run(model.apply, params, tokens, positions, mask)[0])
  cached = _prefill_then_decode(model, params, tokens, mask, positions, prefill=4, slots=13)
  nopad = np.asarray(_run(model.apply, params, tokens, positions, np.ones_like(mask))[0])

  einsum_reference()
  ref_full = np.asarray(_run(model.apply, params, tokens, positions, mask)[0])
  ref_cached = _prefill_then_decode(model, params, tokens, mask, positions, prefill=4, slots=13)
  np.testing.assert_allclose(full[real], ref_full[real], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(cached[real], ref_cached[real], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(cached[real], full[real], atol=2e-5, rtol=1e-5)
  # The padding really is masked: attending to the pad tokens moves the padded rows' logits.
  assert np.max(np.abs(nopad[1:][real[1:]] - full[1:][real[1:]])) > 1e-2
  assert np.std(full[real], axis=-1).min() > 0.05


@pytest.mark.slow
def test_engine_recovers_from_a_cache_a_diverged_call_left_nan(random_params):
  """The engine reuses (donates) its cache across calls. After a call that left NaN in every slot,
  the next call samples exactly what a fresh engine samples; fed straight to a decode step, the
  same NaN cache does poison the logits (slots past the filled part meet a zero weight, not a mask)."""
  model = Model(_cfg())
  params = random_params(model, seed=1, std=0.4)
  prompts, sp = [[5, 9, 3], [7, 1, 4, 4, 2, 8]], SamplingParams(max_new_tokens=8, temperature=1.0)
  engine = JaxEngine(model, params, max_len=24, pad_id=0, eos_ids=())
  engine.generate(prompts, sp, seed=0)
  engine._cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x.ndim == 4 else x, engine._cache)
  nan_cache = jax.tree.map(lambda x: x.copy(), engine._cache)
  a = engine.generate(prompts, sp, seed=1)
  b = JaxEngine(model, params, max_len=24, pad_id=0, eos_ids=()).generate(prompts, sp, seed=1)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
  assert np.isfinite(np.asarray(a.rollout_logprobs)).all()
  kv_mask = jnp.zeros((2, nan_cache["layers"][0]["k"].shape[2]), bool).at[:, 0].set(True)
  one = jnp.ones((2, 1), jnp.int32)
  logits, _ = model.apply(params, one, one * 0, kv_mask, {**nan_cache, "index": jnp.zeros((), jnp.int32)})
  assert np.isnan(np.asarray(logits)).all()


# --- attention backend choice ------------------------------------------------------------------

@pytest.fixture
def notices(monkeypatch, caplog):
  monkeypatch.setattr(attention, "_noticed", set())
  monkeypatch.setattr(attention, "_cudnn_verdicts", {})
  caplog.set_level(logging.WARNING, logger=attention.__name__)
  return lambda: [r.getMessage() for r in caplog.records if r.name == attention.__name__]


@pytest.mark.parametrize("requested,platform,dtype,head_dim,want,why", [
    ("auto", "gpu", jnp.bfloat16, 128, "cudnn", None),
    ("auto", "gpu", jnp.float16, 256, "cudnn", None),
    ("auto", "cpu", jnp.bfloat16, 128, "xla", None),
    ("auto", "tpu", jnp.bfloat16, 128, "xla", None),
    ("xla", "gpu", jnp.bfloat16, 128, "xla", None),
    ("auto", "gpu", jnp.float32, 128, "xla", "dtype float32"),
    ("auto", "gpu", jnp.bfloat16, 12, "xla", "head_dim 12"),
    ("auto", "gpu", jnp.bfloat16, 320, "xla", "head_dim 320"),
    ("cudnn", "cpu", jnp.bfloat16, 128, "xla", "the cpu backend"),
])
def test_attention_backend_choice_and_one_notice(requested, platform, dtype, head_dim, want, why, notices):
  for _ in range(2):
    assert attention.attention_backend(requested, dtype, head_dim, platform) == want
  got = notices()
  if why is None:
    assert got == []
  else:
    assert len(got) == 1 and why in got[0] and "XLA" in got[0], got  # once, however often traced


@pytest.mark.slow
def test_cudnn_refusal_falls_back_to_xla_never_a_crash(random_params, notices, monkeypatch):
  """A bf16 model on a (stand-in) GPU picks cuDNN; this CPU's jax has no cuDNN, so tracing it fails
  and the forward and the gradient fall back to XLA with one notice, matching the XLA model at every
  real position (the rows cuDNN would have taken left-aligned: padded positions attend differently)."""
  cfg = _cfg(dtype="bfloat16")
  params = random_params(Model(cfg), seed=2, std=0.3)
  tokens, mask, positions = _padded(np.random.default_rng(2))
  real = mask.astype(bool)
  xla = Model(cfg.replace(attention_impl="xla"))
  want = np.asarray(_run(xla.apply, params, tokens, positions, mask)[0])[real]
  loss = lambda m: lambda p: jnp.sum(jnp.where(real, m.apply(p, tokens, positions, mask)[0][..., 0], 0))
  want_g = jax.jit(jax.grad(loss(xla)))(params)

  monkeypatch.setattr(attention, "_platform", lambda: "gpu")
  auto = Model(cfg)
  assert attention.attention_backend("auto", jnp.bfloat16, cfg.head_dim, "gpu") == "cudnn"
  got = np.asarray(_run(auto.apply, params, tokens, positions, mask)[0])[real]
  got_g = jax.jit(jax.grad(loss(auto)))(params)
  np.testing.assert_array_equal(got, want)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  got_notices = notices()
  assert len(got_notices) == 1 and "cuDNN rejected" in got_notices[0] and "cuDNN is not detected" in got_notices[0]


def test_unknown_attention_impl_is_a_clear_error():
  with pytest.raises(UnsupportedModelError, match="attention_impl='flash'.*auto, xla, cudnn"):
    _cfg(attention_impl="flash")


# --- FP8 matmuls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("gran", ["channel", "tensor"])
@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_dot_is_the_fake_quant_product(gran, transposed):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(0, 1, (2, 5, 32)), jnp.float32)
  w = jnp.asarray(rng.normal(0, 0.2, (32, 16)) * rng.uniform(0.1, 3, (1, 16)), jnp.float32)
  packed = quant.quantize(w, quant.QuantFormat("fp8_e4m3", gran))
  if transposed:  # [out, in], the layout an FP8 GEMM reads (opdjax.models.inference.prepare)
    packed = packed.replace(q=packed.q.T, transposed=True)
  got = quant.fp8_dot(x, packed)
  sx = quant.absmax_scale(x, "fp8_e4m3", axis=-1)
  x_fake = quant.round_to_format(x / sx, "fp8_e4m3").astype(jnp.float32) * sx
  want = x_fake @ quant.quantize(w, quant.QuantFormat("fp8_e4m3", gran)).dequantize()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(got - x @ w))) > 1e-2  # the rounding is really there


def _fp8_models():
  cfg = _cfg()
  return Model(cfg.replace(act_quant="fp8_e4m3", fp8_matmul=True)), Model(cfg.replace(act_quant="fp8_e4m3"))


@pytest.mark.slow
def test_fp8_matmul_engine_matches_the_fake_quant_w8a8_engine(random_params):
  fp8, fake_model = _fp8_models()
  params = random_params(fp8, seed=4, std=0.4)
  recipe = [("*", "fp8_e4m3:channel")]
  packed = perturb.apply_recipe(params, recipe, pack=True)
  fake = perturb.apply_recipe(params, recipe)
  sp = SamplingParams(max_new_tokens=8, temperature=0.0)
  prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8]]
  engine = JaxEngine(fp8, packed, max_len=24, pad_id=0, eos_ids=())
  held = engine._params["layers"][1]["gate_up"]
  assert held.transposed and held.q.dtype == jnp.float8_e4m3fn and held.q.shape == (128, 32)  # [out, in]
  a = engine.generate(prompts, sp, seed=0)
  b = JaxEngine(fake_model, fake, max_len=24, pad_id=0, eos_ids=()).generate(prompts, sp, seed=0)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4)
  c = JaxEngine(Model(_cfg()), fake, max_len=24, pad_id=0, eos_ids=()).generate(prompts, sp, seed=0)
  assert float(jnp.max(jnp.abs(c.rollout_logprobs - a.rollout_logprobs))) > 1e-4  # fp8 activations show


def _decode_export_text(model, params, platforms):
  cache = jax.eval_shape(lambda: model.init_cache(2, 16))
  b = jax.ShapeDtypeStruct((2,), jnp.int32)
  fn = jax.jit(functools.partial(decode_step, model=model), donate_argnums=1)
  prepared = jax.eval_shape(lambda p: install_params(p, model), params)
  exported = jax.export.export(fn, platforms=platforms)(prepared, cache, b, b, b)
  assert exported.platforms == tuple(platforms)
  return exported.mlir_module()


def _fp8_dots(text: str) -> list[str]:
  return [line for line in text.splitlines()
          if "stablehlo.dot_general" in line and re.search(r"\(tensor<[^>]*xf8E4M3FN>, tensor<[^>]*xf8E4M3FN>\)", line)]


def test_fp8_decode_step_exported_for_cuda_multiplies_fp8(random_params):
  """The CUDA program of one decode step multiplies fp8 by fp8 in all 4 (fused) projections of each of
  the 2 layers, each weight read [out, in] (contracting dims [2] x [1]: no transpose before an FP8
  GEMM); the same packed weights without fp8_matmul are W8A16 (bf16 activations: no fp8 x fp8 dot)."""
  fp8, fake_model = _fp8_models()
  packed = jax.eval_shape(lambda: perturb.apply_recipe(fp8.init(jax.random.key(0)), [("*", "fp8_e4m3:channel")],
                                                       pack=True))
  dots = _fp8_dots(_decode_export_text(fp8, packed, ["cuda"]))
  assert len(dots) == 8, dots
  assert all("contracting_dims = [2] x [1]" in d and "xf32>" in d.split("->")[-1] for d in dots), dots
  assert _fp8_dots(_decode_export_text(fake_model, packed, ["cuda"])) == []


def test_fp8_on_a_gpu_without_fp8_is_one_error_naming_the_capability():
  old = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
  with pytest.raises(UserError, match=r"compute capability >= 8\.9.*A100.*has compute capability 8\.0"):
    quant.check_fp8_support(old)
  for ok in ("8.9", "9.0", "10.0"):
    quant.check_fp8_support(types.SimpleNamespace(platform="gpu", compute_capability=ok, device_kind="gpu"))
  quant.check_fp8_support(jax.devices()[0])  # the CPU: XLA upcasts, no error
  with pytest.raises(UnsupportedModelError, match="act_quant='fp8_e4m3'"):
    _cfg(fp8_matmul=True)


# --- train step: the teacher's vocab projection --------------------------------------------------

def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        if isinstance(sub, jcore.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jcore.Jaxpr):
          yield from _eqns(sub)


def _dots_with_operand(fn, shape, *args) -> int:
  """dot_generals anywhere in `fn`'s program (scan bodies, remat, custom VJPs) with an operand of `shape`."""
  return sum(1 for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr)
             if e.primitive.name == "dot_general" and any(getattr(v.aval, "shape", None) == shape for v in e.invars))


def _abstract_batch(b=2, t=16):
  i32, f32 = jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.float32)
  return {"tokens": i32, "targets": i32, "positions": i32, "attention_mask": i32, "loss_mask": f32,
          "rollout_logprobs": f32}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("policy", ["nothing", "dots", "full"])
def test_train_step_computes_the_teacher_vocab_projection_once(policy, tied):
  """Forward only: the loss's custom VJP hands back gradients formed in the forward, so no backward
  (student remat included, teacher under the same policy) recomputes the teacher's [D_t, V] product.
  A `jax.checkpoint` over chunks, as the loss once was, shows up as a second one."""
  student = Model(_cfg(tie_word_embeddings=tied), remat_policy=policy)
  teacher = Model(_cfg(tie_word_embeddings=tied, hidden_size=48), remat_policy=policy)
  opt = make_optimizer(OptimConfig())
  state = jax.eval_shape(lambda: TrainState.create(student.init(jax.random.key(0)), opt))
  t_params = jax.eval_shape(teacher.init, jax.random.key(1))
  step = functools.partial(train_step, student=student, teacher=teacher, optimizer=opt,
                           loss_cfg=LossConfig(kind="full_rkl", chunk=8))
  assert _dots_with_operand(step, (48, 96), state, t_params, _abstract_batch()) == 1

  from opdjax.scoring.rescore import chunked_over_positions

  def rematted(params, batch):
    h_s, _ = student.hidden(params, batch["tokens"], batch["positions"], batch["attention_mask"])
    h_t, _ = teacher.hidden(t_params_c, batch["tokens"], batch["positions"], batch["attention_mask"])
    def kl(hs, ht):
      ls = jax.nn.log_softmax(student.logits(params, hs))
      lt = jax.nn.log_softmax(teacher.logits(t_params_c, jax.lax.stop_gradient(ht)))
      return jnp.sum(jnp.exp(ls) * (ls - lt), -1)
    return jnp.sum(chunked_over_positions(kl, 8, h_s, h_t))

  t_params_c = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t_params)
  assert _dots_with_operand(jax.grad(rematted), (48, 96), state.params, _abstract_batch()) == 2


# --- portability ---------------------------------------------------------------------------------

PORTABLE_CUSTOM_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


def _custom_calls(text: str) -> set[str]:
  return set(re.findall(r"custom_call @([\w.$-]+)", text)) | set(re.findall(r'call_target_name = "([^"]+)"', text))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_paths_export_for_cuda_and_tpu(dtype):
  """The jitted train step, the engine's generate (prefill + decode loop) and one decode step lower
  for CUDA and TPU from this CPU: nothing on the default paths is backend-only."""
  platforms = ["cuda", "tpu"]
  student, teacher = Model(_cfg(dtype=dtype), remat_policy="full"), Model(_cfg(dtype=dtype, hidden_size=48))
  opt = make_optimizer(OptimConfig())
  state = jax.eval_shape(lambda: TrainState.create(student.init(jax.random.key(0)), opt))
  t_params = jax.eval_shape(teacher.init, jax.random.key(1))
  step = jax.jit(functools.partial(train_step, student=student, teacher=teacher, optimizer=opt,
                                   loss_cfg=LossConfig(kind="full_rkl", chunk=8)), donate_argnums=0)
  texts = [jax.export.export(step, platforms=platforms)(state, t_params, _abstract_batch()).mlir_module()]

  engine = JaxEngine(student, None, max_len=32, pad_id=0, eos_ids=(1,))
  generate = engine._fn(SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9))
  p = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  exported = jax.export.export(generate, platforms=platforms)(
      jax.eval_shape(lambda x: install_params(x, student), state.params),
      jax.eval_shape(lambda: student.init_cache(2, 16)), p, jax.ShapeDtypeStruct((2, 8), bool),
      jax.eval_shape(lambda: jax.random.key(0)))
  assert exported.platforms == tuple(platforms)
  texts += [exported.mlir_module(), _decode_export_text(student, state.params, platforms)]
  for text in texts:
    assert "stablehlo.while" in text or "stablehlo.dot_general" in text
    assert _custom_calls(text) <= PORTABLE_CUSTOM_CALLS, _custom_calls(text)
