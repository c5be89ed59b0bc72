"""The engine's decode step as the hardware sees it, checked on CPU: its optimized HLO moves no cache
buffer or weight matrix (no copy, slice, dynamic-slice or transpose of one) and aliases every cache
buffer input -> output; its CUDA/TPU export carries the same; the fp8 cache stores exactly the `kv`
view's rounding; W8A16 weights stay fp8 in the engine; the loop stays on the device."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.models import Model, ModelConfig, inference, kv_cache
from opdjax.models.layers import kv_fake_quant
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.rollout.jax import engine as engine_mod
from opdjax.rollout.jax.engine import decode_step, decode_step_program, install_params
from opdjax.scoring.rescore import batch_from_rollout, token_logprobs
from opdjax.views import perturb

B, SLOTS = 3, 16  # every dim below differs from these and from each other where it matters


def _cfg(**kw):
  base = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8)
  return ModelConfig(**{**base, **kw})


def _big_shapes(model: Model) -> set[tuple[int, ...]]:
  """The shapes a decode step must never copy: a cache buffer or any window of one (either layout),
  and every weight matrix the engine holds (either orientation)."""
  cfg = model.cfg
  k, e = cfg.num_kv_heads, cfg.head_dim
  shapes = {s for w in range(2, SLOTS + 1) for s in ((B, k, w, e), (B, w, k, e), (B, k, w))}
  prepared = jax.eval_shape(lambda: install_params(model.init(jax.random.key(0)), model))
  for leaf in jax.tree.leaves(prepared):
    if leaf.ndim == 2:
      shapes |= {tuple(leaf.shape), tuple(leaf.shape[::-1])}
  return shapes


_OP = re.compile(r"=\s*\w+\[([\d,]*)\](?:\{[^}]*\})?\s+(copy|transpose|slice|dynamic-slice)\(")


def moved_buffers(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
  """Instructions anywhere in the module (fusion bodies too) that copy, slice or transpose one of `shapes`."""
  out = []
  for line in hlo.splitlines():
    m = _OP.search(line)
    if m and tuple(int(d) for d in m.group(1).split(",") if d) in shapes:
      out.append(line.strip()[:160])
  return out


def aliased_cache_params(hlo: str) -> tuple[set[int], set[int]]:
  """(the entry parameters that are cache buffers, those aliased to an output)."""
  entry = hlo[hlo.index("\nENTRY"):]
  cache = {int(n) for n, name in re.findall(r"parameter\((\d+)\), metadata=\{op_name=\"([^\"]*)\"", entry)
           if name.startswith("cache[") and "index" not in name}
  aliased = {int(n) for n in re.findall(r"\{[\d,]*\}: \((\d+), \{\}, (?:may|must)-alias\)", hlo)}
  return cache, aliased


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w-]+)\(%?([\w.-]*)")


def widened_buffers(hlo: str, shapes: set[tuple[int, ...]]) -> dict[str, list[str]]:
  """Converts (and multiplies) anywhere in the module whose result has one of `shapes`, by kind:
  `plain`: fp8 bits to the compute dtype, an fp8 cache's or W8A16 matrix's operand of its dot (XLA
  fuses it into the dot on a GPU); `cpu_upcast`: bf16 to f32, and f32 back to bf16 after a cache write,
  XLA:CPU's own (it runs bf16 dots and in-place writes in f32, the CPU numbers' known cost); `other`:
  anything else, e.g. a scale broadcast multiplied into a cache-sized buffer, or a widened copy of one."""
  defs = {}
  for line in hlo.splitlines():
    m = _DEF.match(line)
    if m:
      name, dt, shape, op, arg = m.groups()
      defs[name] = (dt, tuple(int(d) for d in shape.split(",") if d), op, arg, line.strip()[:160])
  out = {"plain": [], "cpu_upcast": [], "other": []}
  for dt, shape, op, arg, line in defs.values():
    if shape not in shapes or op not in ("convert", "multiply"):
      continue
    src_dt, _, src_op = defs.get(arg, ("?", (), "?"))[:3]
    if op == "convert" and src_dt.startswith("f8"):
      out["plain"].append(line)
    elif op == "convert" and ((src_dt, dt) == ("bf16", "f32") or (dt == "bf16" and src_op == "dynamic-update-slice")):
      out["cpu_upcast"].append(line)
    else:
      out["other"].append(line)
  return out


def _step_hlo(model, packed: bool) -> str:
  """The compiled decode step (`decode_step_program`), with the layer matrices packed fp8 (W8A16) if asked."""
  if not packed:
    return decode_step_program(model, B, SLOTS).as_text()
  recipe = perturb.preset("fp8", model.cfg.num_layers, keep_edge_layers=0)
  prepared = jax.eval_shape(lambda: install_params(
      perturb.apply_recipe(model.init(jax.random.key(0)), recipe, pack=True), model))
  cache = jax.eval_shape(lambda: model.init_cache(B, SLOTS))
  row = jax.ShapeDtypeStruct((B,), jnp.int32)
  fn = jax.jit(functools.partial(decode_step, model=model), donate_argnums=1)
  return fn.lower(prepared, cache, row, row, row).compile().as_text()


# (dtype, kv cache, W8A16 weights) -> cache-sized converts: plain, XLA:CPU's. Measured on XLA:CPU (jax 0.10.2):
# a bf16 cache is written in f32 (2 up and 2 back a layer, plus the dots' upcasts); an fp8 cache is
# converted once a buffer (k, v) straight to the dot's dtype, and XLA:CPU widens the bf16 values once
# more for its f32 P·V dot. Update the numbers only from a program read again.
PROGRAMS = {("float32", "none", False): (0, 0), ("bfloat16", "none", False): (0, 10),
            ("bfloat16", "fp8_e4m3", False): (4, 2), ("float32", "fp8_e4m3", False): (4, 0),
            ("bfloat16", "fp8_e4m3", True): (4, 2), ("bfloat16", "none", True): (0, 10)}


@pytest.mark.parametrize("dtype,kv,packed", list(PROGRAMS))
def test_decode_step_moves_no_cache_or_weight_and_aliases_the_cache(dtype, kv, packed):
  """No copy, slice or transpose of a cache buffer or weight matrix; every cache buffer aliased; and the
  converts of cache or weight size counted: an fp8 cache's k and v each reach their dot as one plain
  convert of the stored bits (its scales go on scores and probabilities, never multiplied into a
  cache-sized buffer), a W8A16 matrix as one of its fp8 values."""
  model = Model(_cfg(dtype=dtype, kv_quant=kv))
  hlo = _step_hlo(model, packed)
  shapes = _big_shapes(model)
  assert moved_buffers(hlo, shapes) == []
  cache, aliased = aliased_cache_params(hlo)
  per_layer = 4 if kv != "none" else 2  # k, v (+ their scales)
  assert len(cache) == per_layer * model.cfg.num_layers and cache <= aliased, (cache, aliased)
  if kv != "none":
    assert "u8[3,2,16,8]" in hlo and "f32[3,2,16]" in hlo  # the fp8 bits and their per-token scales
  cache_shape = {(B, model.cfg.num_kv_heads, SLOTS, model.cfg.head_dim)}
  got = widened_buffers(hlo, cache_shape)
  assert got["other"] == [] and (len(got["plain"]), len(got["cpu_upcast"])) == PROGRAMS[(dtype, kv, packed)], got
  # Matrices only: a [B, K, S] scale buffer times a constant (the score's 1/sqrt(E) folded into k_scale) is
  # 1/E of the cache, and no widening of it.
  weights = widened_buffers(hlo, {s for s in shapes if len(s) == 2})
  assert weights["other"] == [], weights["other"]
  # A W8A16 matrix is converted once, where its dot reads it (q|k|v, o, gate|up, down a layer).
  assert len(weights["plain"]) == (4 * model.cfg.num_layers if packed else 0), weights["plain"]


def test_the_hlo_check_sees_what_it_forbids():
  """A program that transposes a cache buffer and slices a window of it is caught; one that
  returns a fresh cache instead of the donated one shows no alias."""
  model = Model(_cfg())
  cache = jax.ShapeDtypeStruct((B, 2, SLOTS, 8), jnp.float32)
  bad = jax.jit(lambda c: (jnp.swapaxes(c, 1, 2) * 2, c[:, :, :8] + 1)).lower(cache).compile().as_text()
  assert len(moved_buffers(bad, _big_shapes(model))) >= 1
  fp8 = jax.ShapeDtypeStruct((B, 2, SLOTS, 8), jnp.uint8)
  scale = jax.ShapeDtypeStruct((B, 2, SLOTS), jnp.float32)
  widened = jax.jit(lambda c, s: (jax.lax.bitcast_convert_type(c, jnp.float8_e4m3fn).astype(jnp.float32)
                                  * s[..., None]).astype(jnp.bfloat16)).lower(fp8, scale).compile().as_text()
  assert widened_buffers(widened, _big_shapes(model))["other"] != []  # the scale multiplied into the cache
  fresh = jax.jit(lambda c: jnp.zeros_like(c), donate_argnums=0)
  assert "input_output_alias" not in fresh.lower(cache).compile().as_text()


def _export_text(model, platforms):
  prepared = jax.eval_shape(lambda: install_params(model.init(jax.random.key(0)), model))
  cache = jax.eval_shape(lambda: model.init_cache(B, SLOTS))
  row = jax.ShapeDtypeStruct((B,), jnp.int32)
  fn = jax.jit(functools.partial(decode_step, model=model), donate_argnums=1)
  exported = jax.export.export(fn, platforms=platforms)(prepared, cache, row, row, row)
  assert exported.platforms == tuple(platforms)
  return exported.mlir_module()


@pytest.mark.parametrize("kv", ["none", "fp8_e4m3"])
def test_decode_step_exports_for_cuda_and_tpu_without_moving_the_cache(kv):
  """One export carries both platforms' branches of the decode-attention dispatcher (the XLA path on
  both, no custom call), and no transpose or slice in either touches a cache-sized array."""
  model = Model(_cfg(dtype="bfloat16", kv_quant=kv))
  text = _export_text(model, ["cuda", "tpu"])
  assert "stablehlo.case" in text  # the platform dispatch (one branch per platform group)
  assert re.findall(r"custom_call @([\w.$-]+)", text) == []
  cache_dims = re.compile(r"tensor<3x(2x16|16x2)x8x|tensor<3x2x16x(f32|ui8)>")  # buffers (any layout), scales
  moved = [ln for ln in text.splitlines() if re.search(r"stablehlo\.(transpose|slice|dynamic_slice)\b", ln)
           and cache_dims.search(ln)]
  assert moved == []
  assert sum("stablehlo.dynamic_update_slice" in ln for ln in text.splitlines()) >= 2 * model.cfg.num_layers
  # The XLA path's cache operands: no scale multiplied into a cache-sized buffer; every convert of one
  # (fp8 only) is a plain one of the stored bits (bitcast u8 -> fp8, then fp8 -> bf16), per platform.
  buf = re.compile(r"tensor<3x2x16x8x")
  lines = [ln for ln in text.splitlines() if buf.search(ln)]
  assert [ln for ln in lines if "stablehlo.multiply" in ln] == []
  converts = [ln for ln in lines if re.search(r"stablehlo\.convert\b", ln)]
  assert all(re.search(r"\(tensor<3x2x16x8xf8E4M3FN>\) -> tensor<3x2x16x8xbf16>", ln) for ln in converts), converts
  # k and v a layer: both platforms' branches call the one lowered reference.
  assert len(converts) == (2 * model.cfg.num_layers if kv != "none" else 0)


# --- the fp8 cache -------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", ["per_head", "static"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_the_fp8_cache_stores_exactly_the_kv_views_rounding(fmt, scale):
  cfg = _cfg(kv_quant=fmt, kv_scale=scale, dtype="bfloat16")
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.normal(0, 3, (B, 5, 2, 8)), jnp.bfloat16)  # [B, T, K, E], 5 new tokens
  v = jnp.asarray(rng.normal(0, 0.01, (B, 5, 2, 8)), jnp.bfloat16)
  layer = kv_cache.init_cache(cfg, B, SLOTS)["layers"][0]
  layer = kv_cache.write(layer, k, v, jnp.asarray(4), cfg)
  assert layer["k"].dtype == jnp.uint8 and ("k_scale" in layer) == (scale == "per_head")
  for name, x in (("k", k), ("v", v)):
    got = kv_cache.read(layer, name, jnp.bfloat16, cfg)[:, :, 4:9]
    want = jnp.swapaxes(kv_fake_quant(x, cfg), 1, 2)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32) - jnp.swapaxes(x, 1, 2).astype(jnp.float32)))) > 0


def _rollout(model, params, eos_ids=(), n=8):
  prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8], [11, 12]]
  e = JaxEngine(model, params, max_len=24, pad_id=0, eos_ids=eos_ids)
  return e, e.generate(prompts, SamplingParams(max_new_tokens=n, temperature=1.0), seed=3)


def _gap(lp, batch, reduce=np.max) -> float:
  m = np.asarray(batch["loss_mask"]) > 0
  return float(reduce(np.abs(np.asarray(lp - batch["rollout_logprobs"])[m])))


# fp32: exact up to summation order. bf16: the decode path and the full forward round differently
# (measured on these models: a clean bf16 engine's mean |gap| 0.005-0.009 nats, max 0.017-0.024). The fp8
# engine puts the scales on scores and probabilities in fp32, where the view multiplies by bf16(fp8 * scale):
# one bf16 rounding fewer, so its gap to the view is larger (this rollout, 2026-12-06: mean 0.016, max 0.051;
# with the widened dequantize before: 0.008, 0.023), and still a third of the clean model's (mean 0.050).
@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 7e-2)])
def test_kv_view_rescoring_equals_the_fp8_cache_engine(random_params, dtype, tol):
  """The `kv` view's full forward (keys and values rounded by `kv_fake_quant`) re-scores the fp8
  cache engine's tokens to its own log-probs; the rounding is really there (the clean model differs)."""
  clean = Model(_cfg(dtype=dtype))
  params = random_params(clean, seed=2, std=0.4)
  fp8 = Model(clean.cfg.replace(kv_quant="fp8_e4m3"))
  engine, r = _rollout(fp8, params)
  assert engine._cache["layers"][0]["k"].dtype == jnp.uint8
  batch = batch_from_rollout(r)
  assert _gap(token_logprobs(fp8, params, batch), batch) < tol
  assert _gap(token_logprobs(clean, params, batch), batch, np.mean) > {"float32": 1e-3, "bfloat16": 2e-2}[dtype]
  assert _gap(token_logprobs(clean, params, batch), batch, np.mean) > 2 * _gap(
      token_logprobs(fp8, params, batch), batch, np.mean)


# --- W8A16 ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_w8a16_engine_holds_fp8_weights_and_matches_the_weights_view(random_params, dtype, tol):
  """A `weights` view's packed fp8 (per-channel) matrices stay fp8 in the engine, q|k|v fused, scales
  applied after the dot; its log-probs are the fake-quant view's re-scoring: the same fp8 values, exact
  in fp32. In bf16 the view multiplies by bf16(q * scale), the engine by q and then the scale, so the
  mean gap is bf16's (0.015-0.019 nats here, against 0.014-0.015 when the engine rounded as the view)."""
  model = Model(_cfg(dtype=dtype))
  params = random_params(model, seed=5, std=0.4)
  recipe = [("layers.*", "fp8_e4m3:channel")]
  engine, r = _rollout(model, perturb.apply_recipe(params, recipe, pack=True))
  qkv = engine._params["layers"][0]["qkv"]
  assert isinstance(qkv, inference.W8A16) and qkv.q.dtype == jnp.float8_e4m3fn and qkv.q.shape == (32, 64)
  assert qkv.scale.shape == (1, 64)
  batch = batch_from_rollout(r)
  fake = perturb.apply_recipe(params, recipe)
  reduce = np.max if dtype == "float32" else np.mean
  assert _gap(token_logprobs(model, fake, batch), batch, reduce) < tol
  assert _gap(token_logprobs(model, params, batch), batch, np.mean) > 2 * tol  # the fp8 rounding shows


# --- the loop ------------------------------------------------------------------------------------

def _primitives(fn, *args) -> set[str]:
  out, todo = set(), [jax.make_jaxpr(fn)(*args).jaxpr]
  while todo:
    jaxpr = todo.pop()
    for e in jaxpr.eqns:
      out.add(e.primitive.name)
      for v in e.params.values():
        for sub in v if isinstance(v, (list, tuple)) else [v]:
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            todo.append(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            todo.append(sub)
  return out


def test_without_eos_the_loop_has_a_static_trip_count():
  """No EOS: one fixed-length loop (a scan; XLA knows its trip count, no per-token read-back). With
  EOS: a data-dependent loop over chunks of DONE_EVERY steps."""
  model = Model(_cfg())
  prepared = jax.eval_shape(lambda: install_params(model.init(jax.random.key(0)), model))
  cache = jax.eval_shape(lambda: model.init_cache(2, 24))
  p = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  args = (prepared, cache, p, jax.ShapeDtypeStruct((2, 8), bool), jax.eval_shape(lambda: jax.random.key(0)))
  sampling = SamplingParams(max_new_tokens=16)
  loop = lambda eos: functools.partial(engine_mod.generate_loop, model=model, sampling=sampling, eos_ids=eos, pad_id=0)
  assert "while" not in _primitives(loop(()), *args) and "scan" in _primitives(loop(()), *args)
  assert {"while", "scan"} <= _primitives(loop((1,)), *args)


@pytest.mark.slow
def test_testing_done_every_few_steps_samples_the_same(random_params, monkeypatch):
  """EOS rows: chunks of 3 steps (and a remainder), of 1, or one remainder of all 8 sample the same
  tokens; a row that ended holds padding after its EOS."""
  model = Model(_cfg())
  params = random_params(model, seed=7, std=0.4)
  _, first = _rollout(model, params, eos_ids=())
  eos = int(np.asarray(first.completion_tokens)[0, 2])  # row 0 ends at its third token
  runs = []
  for every in (3, 1, 16):
    monkeypatch.setattr(engine_mod, "DONE_EVERY", every)
    runs.append(_rollout(model, params, eos_ids=(eos,))[1])
  for r in runs[1:]:
    np.testing.assert_array_equal(r.completion_tokens, runs[0].completion_tokens)
    np.testing.assert_array_equal(r.rollout_logprobs, runs[0].rollout_logprobs)
  toks, mask = np.asarray(runs[0].completion_tokens), np.asarray(runs[0].completion_mask)
  first_eos = int(np.argmax(toks[0] == eos))
  assert first_eos <= 2 and mask[0, :first_eos + 1].all() and not mask[0, first_eos + 1:].any()
  assert (toks[0, first_eos + 1:] == 0).all()


# --- mismatch on real models, against the scanned engine this one replaced -----------------------

def _engine_mismatch(cfg, params, prompts, n, seeds) -> dict:
  from opdjax.scoring.mismatch import sampled_metrics

  model = Model(cfg)
  engine = JaxEngine(model, params, max_len=max(map(len, prompts)) + n, pad_id=cfg.pad_token_id or 0, eos_ids=())
  k3, r_max = [], []
  for seed in seeds:
    b = batch_from_rollout(engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=1.0), seed=seed))
    m = sampled_metrics(b["rollout_logprobs"], token_logprobs(model, params, b), b["loss_mask"])
    k3.append(float(m["kl_k3_tok"]))
    r_max.append(float(m["abs_r_max"]))
  return {"k3": float(np.mean(k3)), "abs_r_max": max(r_max)}


@pytest.mark.slow
def test_engine_mismatch_on_the_demo_and_smollm2_is_no_worse_than_the_scanned_engines(demo_cache):
  """The engine's log-probs against the trainer's re-scoring of the same tokens. The scanned engine
  (commit 5daaaa2, these prompts and seeds, measured 2026-12-04) gave: demo student fp32 k3 3.0e-14,
  |log ratio| max 1.7e-6; SmolLM2-135M bf16 k3 0.00167 over 6 seeds of 16 rows x 32 tokens (per seed
  0.0013-0.0019; this engine 0.00174, 0.0016-0.0019). The bounds leave the seeds' spread; a decode step
  that attended to a wrong slot or rounded keys unlike the trainer would be orders of magnitude off.
  Update the numbers only with a measurement of both engines on the same prompts."""
  from opdjax.config.schema import Config
  from opdjax.models import load_hf_params
  from opdjax.models.fetch import fetch
  from opdjax.pipeline.build import load_model, make_task

  cfg = Config()
  task = make_task(cfg)
  demo, params = load_model("student", cfg, task)
  rng = np.random.default_rng(0)
  prompts = [list(task.prompt(int(a), int(b))) for a, b in rng.integers(10, 99, (64, 2))]
  got = _engine_mismatch(demo.cfg, params, prompts, 6, [1])
  assert got["k3"] < 1e-12 and got["abs_r_max"] < 1e-4, got

  path = fetch("smollm2-135m", progress=False)
  cfg = ModelConfig.from_pretrained(path).replace(dtype="bfloat16")
  params = load_hf_params(path, cfg)
  prompts = [[1] + [int(x) for x in rng.integers(100, 40000, 12)] for _ in range(16)]
  got = _engine_mismatch(cfg, params, prompts, 32, range(3))
  assert 1e-4 < got["k3"] < 0.0022, got  # bf16 really mismatches; no worse than 0.00167 beyond the spread
