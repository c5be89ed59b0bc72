"""The CUDA decode-attention kernel (opdjax.models.decode_kernel) in Pallas's interpret mode on CPU,
against the XLA reference it replaces on a GPU (`kv_cache.attention_reference`): bf16 and fp8 caches,
left padding, ragged rows, a row that ended at EOS, a cache whose length is no multiple of the block;
and its CUDA lowering: one kernel call per layer, nothing cache-sized moved around it."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.models import Model, ModelConfig, decode_kernel, kv_cache, quant
from opdjax.rollout.jax.engine import decode_step, install_params

B, K, G, E, SLOTS = 4, 2, 3, 16, 40  # 40 slots: blocks of 32, the last one clamped to [8, 40)


def _cfg(**kw):
  base = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=K * G,
              num_kv_heads=K, head_dim=E, dtype="bfloat16")
  return ModelConfig(**{**base, **kw})


def _filled(cfg, index, start, seed=0):
  """A cache layer whose slots [0, index] hold fresh keys and values written as the engine writes them."""
  rng = np.random.default_rng(seed)
  k, v = (jnp.asarray(rng.normal(0, 2, (B, index + 1, K, E)), jnp.float32) for _ in range(2))
  layer = kv_cache.init_cache(cfg, B, SLOTS)["layers"][0]
  layer = kv_cache.write(layer, k, v, jnp.asarray(0), cfg)
  q = jnp.asarray(rng.normal(0, 1, (B, K, G, E)), jnp.dtype(cfg.dtype))
  return q, layer, jnp.asarray(start, jnp.int32), jnp.asarray(index, jnp.int32)


def _both(cfg, q, layer, start, index):
  dt = jnp.dtype(cfg.dtype)
  fp8 = quant.FP8_DTYPES[cfg.kv_quant] if kv_cache.quantized(cfg) else None
  got = decode_kernel.decode_attention(q, layer, start, index, dt, fp8, interpret=True)
  want = kv_cache.attention_reference(q[:, None], layer, start, index, dt, cfg)[:, 0]
  return np.asarray(got, np.float32), np.asarray(want, np.float32)


# Rows: full from slot 0; left-padded by 5; ragged (its prompt starts at 29, past the first block); a row
# that ended at EOS early and has been writing padding since (its slots are filled all the same).
STARTS = [0, 5, 29, 2]


# index 37: the clamped last block; 31: a block's last slot.
@pytest.mark.parametrize("dtype,kv,scale,index", [
    ("bfloat16", "none", "per_head", 37), ("float32", "none", "per_head", 31), ("bfloat16", "fp8_e4m3", "per_head", 37),
    ("bfloat16", "fp8_e4m3", "static", 31), ("float32", "fp8_e5m2", "per_head", 37)])
def test_kernel_equals_the_reference_in_interpret_mode(dtype, kv, scale, index):
  cfg = _cfg(dtype=dtype, kv_quant=kv, kv_scale=scale)
  q, layer, start, idx = _filled(cfg, index, STARTS)
  got, want = _both(cfg, q, layer, start, idx)
  tol = (2e-2 if dtype == "bfloat16" else 1e-5) * float(np.max(np.abs(want)))
  np.testing.assert_allclose(got, want, atol=tol, rtol=0)
  # What the comparison can catch: one slot fewer for each row gives another answer.
  _, shifted = _both(cfg, q, layer, start + 1, idx)
  assert float(np.max(np.abs(shifted - want))) > 5 * tol


def test_kernel_reads_only_the_blocks_holding_filled_slots():
  """NaN in every slot outside the blocks from each row's first filled slot to `index` never reaches the
  output: those slots are not read (the reference, which reads the whole buffer, turns NaN)."""
  cfg = _cfg()
  index, starts = 20, [0, 5, 16, 18]  # blocks of 32: rows read [0, 32)
  q, layer, start, idx = _filled(cfg, index, starts)
  want = _both(cfg, q, layer, start, idx)[1]
  block = decode_kernel.block_for(SLOTS)
  # Only the second block (slots 32..39 lie beyond `index`) is poisoned: rows read [0, 32).
  poisoned = {n: layer[n].at[:, :, block:].set(jnp.nan) for n in ("k", "v")}
  got, ref = _both(cfg, q, {**layer, **poisoned}, start, idx)
  assert np.isnan(ref).any()
  np.testing.assert_allclose(got, want, atol=2e-2 * float(np.max(np.abs(want))), rtol=0)


def test_kernel_takes_only_shapes_triton_can():
  assert decode_kernel.fits(4096, 128) and decode_kernel.fits(16, 16) and decode_kernel.block_for(40) == 32
  assert not decode_kernel.fits(15, 128) and not decode_kernel.fits(4096, 8) and not decode_kernel.fits(4096, 96)


# --- its CUDA lowering in the engine's decode step -----------------------------------------------

def _step_text(model, batch=3, slots=32) -> str:
  prepared = jax.eval_shape(lambda: install_params(model.init(jax.random.key(0)), model))
  cache = jax.eval_shape(lambda: model.init_cache(batch, slots))
  row = jax.ShapeDtypeStruct((batch,), jnp.int32)
  fn = jax.jit(functools.partial(decode_step, model=model), donate_argnums=1)
  return fn.trace(prepared, cache, row, row, row).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kv", ["none", "fp8_e4m3"])
def test_the_cuda_decode_step_calls_the_kernel_once_per_layer(kv):
  """One Triton call a layer, fed the cache buffers as they lie (no transpose, slice or convert of a
  cache-sized array around it); a head_dim the kernel cannot take keeps the XLA reference."""
  model = Model(_cfg(kv_quant=kv, num_layers=3))
  text = _step_text(model)
  calls = re.findall(r"custom_call @([\w.$-]+)", text)
  assert calls == ["__gpu$xla.gpu.triton"] * model.cfg.num_layers, calls
  cache = re.compile(r"tensor<3x(2x32|32x2)x16x|tensor<3x2x32x(f32|ui8)>")
  moved = [ln.strip()[:160] for ln in text.splitlines() if cache.search(ln) and re.search(
      r"stablehlo\.(transpose|slice|dynamic_slice|convert|bitcast_convert|multiply)\b", ln)]
  assert moved == []
  narrow = Model(_cfg(kv_quant=kv, head_dim=8))
  assert re.findall(r"custom_call @([\w.$-]+)", _step_text(narrow)) == []
