"""Mismatch metrics, perturbations and engine views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig, quant
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.scoring.mismatch import exact_kl, sampled_metrics
from opdjax.scoring.rescore import batch_from_rollout, masked_mean, token_logprobs
from opdjax.views import perturb
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView


def _model(layers=2):
  cfg = ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=layers,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  m = Model(cfg)
  return m, jax.tree.map(lambda x: 2.5 * x if x.ndim == 2 else x, m.init(jax.random.key(0)))


PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(1, 40, 1 + i % 5)] for i in range(32)]
SP = SamplingParams(max_new_tokens=8)


# --- metrics -------------------------------------------------------------------------------------

def test_sampled_metrics_against_numpy():
  rng = np.random.default_rng(0)
  q = rng.normal(-2, 1, (3, 5))
  p = q + rng.normal(0, 0.3, (3, 5))
  mask = np.ones((3, 5))
  mask[1, 3:] = 0
  mask[2] = 0  # an empty row counts in neither token nor sequence averages
  m = {k: float(v) for k, v in sampled_metrics(jnp.asarray(q), jnp.asarray(p), jnp.asarray(mask)).items()}
  r = (p - q)[mask > 0]
  np.testing.assert_allclose(m["kl_k1_tok"], np.mean(-r), rtol=1e-5)
  np.testing.assert_allclose(m["kl_k3_tok"], np.mean(np.exp(r) - r - 1), rtol=1e-5)
  seq = [np.mean(np.exp(x) - x - 1) for x in ((p - q)[0], (p - q)[1, :3])]
  np.testing.assert_allclose(m["kl_k3_seq"], np.mean(seq), rtol=1e-5)
  np.testing.assert_allclose(m["abs_r_max"], np.max(np.abs(r)), rtol=1e-5)
  np.testing.assert_allclose(m["chi2_tok"], np.mean(np.exp(2 * r)) - 1, rtol=1e-5)
  w = np.exp(r)
  np.testing.assert_allclose(m["ess_tok"], w.sum() ** 2 / (len(w) * (w**2).sum()), rtol=1e-5)
  sw = np.exp([(p - q)[0].sum(), (p - q)[1, :3].sum()])
  np.testing.assert_allclose(m["chi2_seq"], np.mean(sw**2) - 1, rtol=1e-4)
  np.testing.assert_allclose(m["prob_corr"], np.corrcoef(np.exp(q[mask > 0]), np.exp(p[mask > 0]))[0, 1], rtol=1e-4)
  assert 0 < m["ess_tok"] < 1


@pytest.mark.slow
def test_k3_estimate_converges_to_exact_kl():
  """Sampling tokens from the rollout distribution q, mean k3 -> KL(q || p)."""
  rng = np.random.default_rng(1)
  logq = jax.nn.log_softmax(jnp.asarray(rng.normal(0, 1.5, 30)))
  logp = jax.nn.log_softmax(logq + jnp.asarray(rng.normal(0, 0.4, 30)))
  exact = float(jnp.sum(jnp.exp(logq) * (logq - logp)))
  errs = []
  for n in (100, 100_000):
    y = jax.random.categorical(jax.random.key(n), logq, shape=(n,))
    m = sampled_metrics(logq[y][None], logp[y][None], jnp.ones((1, n)))
    errs.append(abs(float(m["kl_k3_tok"]) - exact))
  assert exact > 0.01
  assert errs[1] < 0.03 * exact
  assert errs[1] < errs[0]


# --- perturbations -------------------------------------------------------------------------------

@pytest.mark.slow
def test_patterns_select_by_path_and_typos_are_errors():
  _, params = _model()
  assert perturb.match("layers.1.mlp.*", params) == [f"layers.1.mlp.{n}" for n in ("down_proj", "gate_proj", "up_proj")]
  assert "embed_tokens" in perturb.match("embed*", params)
  with pytest.raises(UserError, match="matches nothing"):
    perturb.match("layers.7.mlp.*", params)
  with pytest.raises(UserError, match="unknown weight format"):
    quant.QuantFormat.parse("fp6")
  with pytest.raises(UserError, match="granularity"):
    quant.QuantFormat.parse("fp8_e4m3:row")


def test_fake_quant_error_orders_and_granularity():
  rng = np.random.default_rng(0)
  # Columns with very different scales: per-channel scales must beat one per-tensor scale.
  x = jnp.asarray(rng.normal(0, 1, (200, 130)) * np.logspace(-3, 1, 130))

  def err(spec):
    return float(jnp.sqrt(jnp.mean((quant.fake_quant(x, quant.QuantFormat.parse(spec)) - x) ** 2)))

  assert err("fp32") == 0
  assert 0 < err("bf16") < err("fp8_e4m3:channel") < err("fp8_e5m2:channel")
  assert err("fp8_e4m3:channel") < err("fp8_e4m3:tensor")
  assert err("int8:channel") < err("int8:tensor")
  assert err("fp8_e4m3:block") < err("fp8_e4m3:tensor")  # ragged 200x130 blocks included
  q = quant.fake_quant(x, quant.QuantFormat.parse("fp8_e4m3:tensor"))
  assert bool(jnp.all(jnp.isfinite(q)))
  # FP8 e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values well inside the range.
  big = jnp.abs(x) > 0.1 * jnp.max(jnp.abs(x))
  assert float(jnp.max(jnp.where(big, jnp.abs(q - x) / jnp.abs(x), 0))) <= 2**-4 + 1e-6


ZERO_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")


def _with_zero_groups():
  """`[2, 256, 260]` (a leading layer axis; ragged 128x128 tiles): layer 1 all zeros (a zero tensor),
  and in layer 0 a zero output channel and a zero 128x128 tile; every other entry ~ N(0, 1)."""
  x = np.random.default_rng(0).normal(0, 1, (2, 256, 260)).astype(np.float32)
  x[1] = 0.0
  x[0, :, 3] = 0.0
  x[0, :128, 128:256] = 0.0
  return jnp.asarray(x)


@pytest.mark.parametrize("granularity", quant.GRANULARITIES)
@pytest.mark.parametrize("name", ZERO_FORMATS)
def test_all_zero_groups_quantize_to_exact_zeros(name, granularity):
  """A group whose absmax is 0 must come back as zeros, not 0/0 = NaN, in QArray and fake quant."""
  fmt = quant.QuantFormat(name, granularity)
  x = _with_zero_groups()
  packed = quant.quantize(x, fmt)
  assert bool(jnp.all(jnp.isfinite(packed.q.astype(jnp.float32)))) and bool(jnp.all(packed.scale > 0))
  for y in (packed.dequantize(), quant.fake_quant(x, fmt)):
    assert bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_array_equal(np.asarray(y)[np.asarray(x) == 0], 0.0)
    # The non-zero groups are still quantized, not zeroed with them.
    np.testing.assert_allclose(np.asarray(y[0, 128:, 200:]), np.asarray(x[0, 128:, 200:]), atol=0.35)
  one = quant.fake_quant(jnp.ones((4, 3)).at[:, 1].set(0.0), quant.QuantFormat(name, "channel"))
  np.testing.assert_array_equal(np.asarray(one), np.asarray(jnp.ones((4, 3)).at[:, 1].set(0.0)))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_zero_key_value_vector_survives_per_head_fp8_kv(name):
  from opdjax.models.decoder import kv_fake_quant

  cfg = ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, kv_quant=name, kv_scale="per_head")
  x = jnp.asarray(np.random.default_rng(1).normal(0, 1, (2, 3, 2, 8)), jnp.float32).at[0, 1, 0].set(0.0)
  y = kv_fake_quant(x, cfg)
  assert bool(jnp.all(jnp.isfinite(y)))
  np.testing.assert_array_equal(np.asarray(y[0, 1, 0]), 0.0)
  assert 0 < float(jnp.max(jnp.abs(y - x))) < 0.2  # the other heads are rounded, not zeroed


@pytest.mark.parametrize("act", ["fp8_e4m3", "int8"])
def test_zero_activation_row_survives_w8a8(act):
  from opdjax.models.decoder import Linear

  layer = Linear(5, use_bias=False, dtype=jnp.float32, act_quant=act)
  x = jnp.asarray(np.random.default_rng(2).normal(0, 1, (3, 4)), jnp.float32).at[1].set(0.0)
  variables = layer.init(jax.random.key(0), x)
  y = layer.apply(variables, x)
  assert bool(jnp.all(jnp.isfinite(y)))
  np.testing.assert_array_equal(np.asarray(y[1]), 0.0)
  assert float(jnp.min(jnp.abs(y[0]))) > 0


@pytest.mark.slow
def test_recipe_keeps_norms_out_of_fp8_and_respects_order():
  _, params = _model()
  out = perturb.apply_recipe(params, [("layers.0.*", "bf16"), ("*", "fp8_e4m3:channel")])
  k0 = out["layers"]["self_attn"]["q_proj"]["kernel"][0]
  k1 = out["layers"]["self_attn"]["q_proj"]["kernel"][1]
  assert np.array_equal(k0, k0.astype(jnp.bfloat16).astype(jnp.float32))
  assert len(np.unique(np.abs(np.asarray(k1[:, 0])))) <= 128  # FP8: few distinct magnitudes per channel
  norm = out["layers"]["input_layernorm"]["weight"][1]
  assert np.array_equal(norm, norm.astype(jnp.bfloat16).astype(jnp.float32))
  preset = perturb.preset("fp8", num_layers=4, keep_edge_layers=1)
  assert ("layers.0.*", "bf16") in preset and ("layers.3.*", "bf16") in preset and ("layers.1.*", "bf16") not in preset


@pytest.mark.slow
def test_preset_on_a_tied_model_quantizes_the_shared_embedding_once_in_bf16():
  cfg = ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
  params = Model(cfg).init(jax.random.key(0))
  assert "lm_head" not in params
  out = perturb.apply_recipe(params, perturb.preset("fp8", num_layers=3, keep_edge_layers=0))
  emb = out["embed_tokens"]["embedding"]
  assert np.array_equal(emb, emb.astype(jnp.bfloat16).astype(jnp.float32))
  up = lambda t: t["layers"]["mlp"]["up_proj"]["kernel"][1]
  assert not np.array_equal(up(out), up(params))
  with pytest.raises(UserError, match="'lm_hea' matches nothing"):  # typos are still errors
    perturb.apply_recipe(params, [("lm_hea", "bf16")])


@pytest.mark.slow
def test_noise_is_seeded_relative_and_selective():
  _, params = _model()
  a = perturb.add_weight_noise(params, jax.random.key(0), 0.1)
  b = perturb.add_weight_noise(params, jax.random.key(0), 0.1)
  c = perturb.add_weight_noise(params, jax.random.key(1), 0.1)
  only = perturb.add_weight_noise(params, jax.random.key(0), 0.1, patterns=["layers.1.mlp.*"])
  up = lambda t, i: t["layers"]["mlp"]["up_proj"]["kernel"][i]
  w = up(params, 1)
  d = up(a, 1) - w
  assert jax.tree.all(jax.tree.map(jnp.array_equal, a, b))
  assert not np.array_equal(up(a, 1), up(c, 1))
  np.testing.assert_allclose(jnp.std(d) / jnp.sqrt(jnp.mean(w**2)), 0.1, rtol=0.1)
  assert np.array_equal(up(only, 0), up(params, 0))
  assert np.array_equal(up(only, 1), up(a, 1))


def _three_layers():
  """3 layers whose weights differ in scale by 10x per layer, so one scale shared across the stack
  would give visibly different numbers than one scale per layer."""
  cfg = ModelConfig(model_type="qwen3", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  params = Model(cfg).init(jax.random.key(0))
  scale = jnp.asarray([1.0, 10.0, 100.0])
  layers = jax.tree.map(lambda x: x * scale.reshape((3,) + (1,) * (x.ndim - 1)) if x.ndim == 3 else x,
                        params["layers"])
  return {**params, "layers": layers}


@pytest.mark.slow
def test_stacked_leaves_are_addressed_per_layer():
  params = _three_layers()
  leaves = {(m, n): x.shape for m, n, x in perturb.named_leaves(params)}
  assert leaves[("layers.2.mlp.down_proj", "kernel")] == (64, 32)
  assert leaves[("layers.0.input_layernorm", "weight")] == (32,)
  assert len(perturb.match("*.mlp.*", params)) == 3 * 3
  abstract = perturb.named_leaves(jax.eval_shape(lambda: params))  # shapes only, nothing to slice
  assert [(m, n, x.shape) for m, n, x in abstract] == [(m, n, x.shape) for m, n, x in perturb.named_leaves(params)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["fp8_e4m3:tensor", "fp8_e5m2:channel", "int8:block", "int8:tensor"])
def test_per_layer_recipe_quantizes_exactly_that_layer(spec):
  params = _three_layers()
  fmt = quant.QuantFormat.parse(spec)
  one = perturb.apply_recipe(params, [("layers.1.*", spec)])
  every = perturb.apply_recipe(params, [("*.self_attn.*", spec), ("*.mlp.*", spec)])
  packed = perturb.apply_recipe(params, [("layers.*", spec)], pack=True)
  for path, x in jax.tree_util.tree_flatten_with_path(params["layers"])[0]:
    got, all_layers = (jax.tree_util.keystr(path), x), None
    y = one["layers"]
    for k in path:
      y = y[k.key]
    assert x.shape == y.shape and y.dtype == x.dtype
    for i in (0, 2):  # the other layers' slices are untouched, bit for bit
      np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(x[i]), err_msg=got[0])
    if x.ndim == 3:  # a matrix: layer 1 gets exactly the numbers it gets quantized alone
      np.testing.assert_array_equal(np.asarray(y[1]), np.asarray(quant.fake_quant(x[1], fmt)))
      assert not np.array_equal(np.asarray(y[1]), np.asarray(x[1]))
      all_layers = every["layers"]
      q = packed["layers"]
      for k in path:
        all_layers, q = all_layers[k.key], q[k.key]
      # Every layer selected at once: each slice still gets its own scales (tensor: one per layer).
      for i in range(3):
        np.testing.assert_array_equal(np.asarray(all_layers[i]), np.asarray(quant.fake_quant(x[i], fmt)))
      assert isinstance(q, quant.QArray) and q.scale.shape[0] == 3
      np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(all_layers))
    else:  # norms under a recipe row round to bf16, never to FP8/INT8
      np.testing.assert_array_equal(np.asarray(y[1]), np.asarray(x[1].astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.slow
def test_noise_per_layer_is_independent_of_the_selection():
  params = _three_layers()
  key = jax.random.key(7)
  down = lambda t: np.asarray(t["layers"]["mlp"]["down_proj"]["kernel"])
  every = perturb.add_weight_noise(params, key, 0.1)
  one = perturb.add_weight_noise(params, key, 0.1, patterns=["layers.1.mlp.down_proj"])
  np.testing.assert_array_equal(down(one)[1], down(every)[1])  # layer 1's noise, selected alone or with all
  np.testing.assert_array_equal(down(one)[[0, 2]], down(params)[[0, 2]])
  eps = [(down(every)[i] - down(params)[i]) / np.sqrt(np.mean(down(params)[i] ** 2)) for i in range(3)]
  np.testing.assert_allclose([np.std(e) for e in eps], 0.1, rtol=0.1)  # relative to each layer's own rms
  assert not np.allclose(eps[0], eps[1], atol=1e-3)  # each layer draws its own noise
  scaled = perturb.add_weight_noise(params, key, 0.1, layer_scale=lambda m: 3.0 if m.startswith("layers.2.") else 1.0)
  np.testing.assert_array_equal(down(scaled)[1], down(every)[1])
  np.testing.assert_allclose(down(scaled)[2] - down(params)[2], 3 * (down(every)[2] - down(params)[2]), rtol=1e-4,
                             atol=1e-4)


def test_params_history_gives_exact_lag():
  h = ParamsHistory(3)
  for v in range(5):
    h.push(v, {"w": jnp.full((2,), float(v))})
  assert h.versions == [2, 3, 4]
  assert h.lagged(0)[0] == 4 and h.lagged(2)[0] == 2 and float(h.lagged(2)[1]["w"][0]) == 2.0
  with pytest.raises(UserError, match="lag 3 needs a buffer"):
    h.lagged(3)


# --- engine views: rollouts, re-scoring, monotone mismatch -------------------------------------

def _view_rollout(view, model, params):
  vm, vp = view.model(model), view.transform(params, model.cfg.num_layers)
  r = JaxEngine(vm, vp, max_len=24, pad_id=0, eos_ids=()).generate(PROMPTS, SP, seed=3)
  return vm, vp, batch_from_rollout(r)


@pytest.mark.parametrize("spec", ["clean", "weights=fp8,kv_quant=fp8_e4m3,noise_sigma=0.05,compute_dtype=bfloat16",
                                  "kv_quant=fp8_e5m2,kv_scale=static"])
@pytest.mark.slow
def test_view_rescoring_reproduces_the_engine(spec):
  """A full forward with the view's model and params gives the engine's own log-probs."""
  model, params = _model()
  vm, vp, batch = _view_rollout(EngineView.parse(spec), model, params)
  lp = token_logprobs(vm, vp, batch)
  tol = 1e-4 if "bfloat16" not in spec else 2e-2
  assert float(jnp.max(jnp.abs(lp - batch["rollout_logprobs"]))) < tol
  trainer_lp = token_logprobs(model, params, batch)
  m = sampled_metrics(batch["rollout_logprobs"], trainer_lp, batch["loss_mask"])
  if spec == "clean":
    assert float(m["kl_k3_tok"]) < 1e-8 and float(m["abs_r_max"]) < 1e-4
  else:
    assert float(m["abs_r_max"]) > 1e-3


@pytest.mark.slow
def test_mismatch_grows_with_strength():
  """Exact KL(view || trainer) on one fixed token set: monotone in each perturbation's strength."""
  model, params = _model()
  _, _, batch = _view_rollout(EngineView(), model, params)

  def kl(spec, p=params):
    view = EngineView.parse(spec)
    vm, vp = view.model(model), view.transform(p, model.cfg.num_layers)
    return float(masked_mean(exact_kl(vm, vp, model, params, batch), batch["loss_mask"]))

  assert kl("clean") < 1e-9
  noise = [kl(f"noise_sigma={s}") for s in (0.003, 0.01, 0.03, 0.1)]
  assert all(a < b for a, b in zip(noise, noise[1:])), noise
  precision = [kl("clean"), kl("compute_dtype=bfloat16"), kl("weights=fp8"), kl("weights=fp8_e5m2")]
  assert all(a < b for a, b in zip(precision, precision[1:])), precision
  assert kl("kv_quant=fp8_e4m3") < kl("kv_quant=fp8_e5m2")
  # Staleness: params k optimizer-like steps old (a fixed random walk of updates).
  h = ParamsHistory(5)
  p = params
  for v in range(5):
    h.push(v, p)
    p = jax.tree.map(lambda x, v=v: x + 0.02 * jax.random.normal(jax.random.key(v), x.shape), p)
  h.push(5, p)
  lags = []
  for lag in (0, 1, 2, 4):
    vm = EngineView().model(model)
    lags.append(float(masked_mean(exact_kl(vm, h.lagged(lag)[1], model, h.lagged(0)[1], batch), batch["loss_mask"])))
  assert lags[0] < 1e-9 and all(a < b for a, b in zip(lags, lags[1:])), lags


def test_engine_view_spec_errors():
  with pytest.raises(UserError, match="bad engine-view item"):
    EngineView.parse("weights=fp8,lagg=2")
  with pytest.raises(UserError, match="expected int"):
    EngineView.parse("lag=two")
  assert str(EngineView.parse("weights=fp8,lag=2")) == "weights=fp8,lag=2"
  assert set(EngineView.parse("weights=fp8,lag=2,noise_sigma=0.1").sources()) == {"weights", "lag", "noise"}


# --- end to end: training through a perturbed engine, and the `opdjax mismatch` table ----------

@pytest.mark.slow
def test_training_through_a_lagged_quantized_engine_logs_mismatch(demo_cache, tmp_path):
  import json

  from opdjax import cli

  def run(name, view):
    out = tmp_path / name
    assert cli.main(["train", "--config", "configs/demo.py", "--out", str(out), f"--config.rollout.view={view}",
                     "--config.train.steps=6", "--config.train.eval_every=3"]) == 0
    return [json.loads(line) for line in open(out / "metrics.jsonl")][1:]

  clean, stale = run("clean", "clean"), run("stale", "weights=fp8,kv_quant=fp8_e4m3,lag=2")
  assert [r["params_lag"] for r in stale] == [0, 1, 2, 2, 2, 2]
  assert all(r["params_lag"] == 0 and r["mismatch_kl_k3_tok"] < 1e-6 for r in clean)
  assert all(r["mismatch_kl_k3_tok"] > 1e-5 for r in stale[2:])
  assert all(r["mismatch_abs_r_max"] > 10 * c["mismatch_abs_r_max"] for r, c in zip(stale[2:], clean[2:]))
  assert any(r["opd_signal_rollout"] != r["opd_signal_trainer"] for r in stale)


@pytest.mark.slow
def test_mismatch_cli_table_and_attribution(demo_cache, tmp_path, capsys):
  import json

  from opdjax import cli

  sources = "clean;weights=fp8_e5m2;lag=2;weights=fp8_e5m2,kv_quant=fp8_e5m2,lag=2"
  assert cli.main(["mismatch", "--config", "configs/demo.py", "--out", str(tmp_path),
                   f"--config.mismatch.sources={sources}", "--config.mismatch.warmup_steps=3",
                   "--config.mismatch.num_prompts=32"]) == 0
  printed = capsys.readouterr().out
  res = json.load(open(tmp_path / "mismatch.json"))
  assert list(res["views"]) == ["clean", "weights=fp8_e5m2", "lag=2", "weights=fp8_e5m2,kv_quant=fp8_e5m2,lag=2"]
  assert res["views"]["clean"]["exact_kl"] < 1e-9 and res["views"]["lag=2"]["exact_kl"] > 1e-4
  rows = res["attribution"]["weights=fp8_e5m2,kv_quant=fp8_e5m2,lag=2"]
  assert set(rows) == {"total", "lag", "weights", "kv_cache", "interaction"}
  assert abs(rows["total"] - rows["lag"] - rows["weights"] - rows["kv_cache"] - rows["interaction"]) < 1e-9
  assert all(rows[k] > 0 for k in ("lag", "weights", "kv_cache"))
  assert "attribution of exact KL" in printed and "kl_k3_tok" in printed


@pytest.mark.slow
def test_packed_fp8_engine_matches_fake_quant_and_stores_fp8():
  """Real fp8 storage + on-the-fly dequantization gives the fake-quant engine's exact rollout."""
  model, params = _model()
  view = EngineView(weights="*>fp8_e4m3:channel")
  packed = view.transform(params, 2, pack=True)
  qs = [x for x in jax.tree.leaves(packed, is_leaf=lambda x: isinstance(x, quant.QArray))
        if isinstance(x, quant.QArray)]
  assert qs and all(x.q.dtype == jnp.float8_e4m3fn for x in qs)
  fake = view.transform(params, 2)
  np.testing.assert_array_equal(quant.unpack(packed)["layers"]["mlp"]["up_proj"]["kernel"],
                                fake["layers"]["mlp"]["up_proj"]["kernel"])
  a = JaxEngine(model, packed, max_len=24, pad_id=0, eos_ids=()).generate(PROMPTS, SP, seed=5)
  b = JaxEngine(model, fake, max_len=24, pad_id=0, eos_ids=()).generate(PROMPTS, SP, seed=5)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5)


@pytest.mark.slow
def test_w8a8_view_is_reproduced_by_rescoring_and_adds_mismatch():
  model, params = _model()
  w8a8 = EngineView.parse("weights=int8,act_quant=int8")
  vm, vp, batch = _view_rollout(w8a8, model, params)
  assert float(jnp.max(jnp.abs(token_logprobs(vm, vp, batch) - batch["rollout_logprobs"]))) < 1e-4
  kl = [float(masked_mean(exact_kl(v.model(model), v.transform(params, 2), model, params, batch), batch["loss_mask"]))
        for v in (EngineView.parse("weights=int8"), w8a8)]
  assert 0 < kl[0] < kl[1]


@pytest.mark.slow
def test_quantized_teacher_reports_its_own_mismatch(demo_cache, tmp_path, capsys):
  import json

  from opdjax import cli

  out = tmp_path / "tq"
  assert cli.main(["train", "--config", "configs/demo.py", "--out", str(out), "--config.train.steps=2",
                   "--config.teacher.view=weights=fp8_e5m2,kv_quant=fp8_e5m2"]) == 0
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert all(r["teacher_mismatch_exact_kl"] > 1e-4 for r in recs)
  assert cli.main(["train", "--config", "configs/demo.py", "--out", str(tmp_path / "bad"),
                   "--config.teacher.view=lag=1"]) == 2
  assert "teacher never changes" in capsys.readouterr().err
