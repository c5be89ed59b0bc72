"""Layer sensitivity: perturbations stay local, recipe selection, the recipe beats same-memory choices."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from opdjax import cli
from opdjax.analyses import sensitivity
from opdjax.analyses.sensitivity import Scorer, Settings
from opdjax.config.defaults import default_config
from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.rollout import SamplingParams
from opdjax.scoring.mismatch import exact_kl
from opdjax.scoring.rescore import masked_mean
from opdjax.views import perturb
from opdjax.views.view import EngineView

SP = SamplingParams(max_new_tokens=8, temperature=0.8)
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(3, 40, 2 + i % 4)] for i in range(16)]


def _tiny(draw, model_type="llama", sensitive=None, tied=False, seed=0):
  """A random tiny 4-layer model (`draw`: conftest's random_params). In layer `sensitive`, input
  channel 0 of q/k/v and gate/up becomes an outlier channel: its norm weight / 1e5 and its kernel
  rows * 1e5, the same function (up to fp32 rounding) but each output channel's one scale now
  spans 1e5x, so quantizing that layer wipes out those projections."""
  cfg = ModelConfig(model_type=model_type, vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=tied)
  model = Model(cfg)
  params = draw(model, seed, std=0.1)
  if sensitive is not None:
    layers = params["layers"]  # stacked: [layer, ...]
    for norm, parent, names in (("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),
                                ("post_attention_layernorm", "mlp", ("gate_proj", "up_proj"))):
      layers[norm]["weight"] = layers[norm]["weight"].at[sensitive, 0].divide(1e5)
      for name in names:
        layers[parent][name]["kernel"] = layers[parent][name]["kernel"].at[sensitive, 0].multiply(1e5)
  return model, params


def _scorer(model, params, sampling=SP):
  batch = sensitivity.sample_tokens(model, params, PROMPTS, sampling, seed=0, max_len=32, pad_id=0, eos_ids=())
  return Scorer(model, params, batch, sampling, chunk=8)


@pytest.fixture(scope="module")
def llama(random_params):
  model, params = _tiny(random_params, sensitive=1, seed=1)
  return model, params, _scorer(model, params)


@pytest.fixture(scope="module")
def qwen3_tied(random_params):
  """Fixed random tokens instead of sampled ones (the re-scoring does not care; saves a decode compile)."""
  model, params = _tiny(random_params, "qwen3", sensitive=2, tied=True, seed=2)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 40, (8, 12)), jnp.int32)
  batch = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(12), (8, 12)),
           "attention_mask": jnp.ones((8, 12), bool), "loss_mask": jnp.asarray(rng.random((8, 6)) < 0.9, jnp.float32)}
  return model, params, Scorer(model, params, batch, SP, chunk=8)


# --- perturbations stay where they are put ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("perturbation", ["fp8_e4m3:channel", "int8:channel", "noise:0.1"])
def test_one_layer_perturbed_leaves_every_other_layer_bit_identical(llama, perturbation):
  _, params, _ = llama
  pp = sensitivity.perturbed(params, ["layers.2.*"], perturbation, jax.random.key(0))
  assert jax.tree.structure(pp) == jax.tree.structure(params)
  changed = set()
  for (mod, leaf, a), (mod_b, leaf_b, b) in zip(perturb.named_leaves(params), perturb.named_leaves(pp), strict=True):
    assert (mod, leaf) == (mod_b, leaf_b) and a.dtype == b.dtype and a.shape == b.shape
    if not np.array_equal(np.asarray(a), np.asarray(b)):
      changed.add(mod.split(".")[:2] == ["layers", "2"])
  assert changed == {True}  # only layer 2's slices of the stacked params
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # every matrix of that layer really changed
    before, after = params["layers"]["self_attn"][name]["kernel"][2], pp["layers"]["self_attn"][name]["kernel"][2]
    assert not np.array_equal(before, after)


def test_one_kind_perturbed_touches_only_that_projection(llama):
  _, params, _ = llama
  pp = sensitivity.perturbed(params, ["*.self_attn.q_proj"], "fp8_e5m2:channel", jax.random.key(0))
  for mod, leaf, x in perturb.named_leaves(params):
    y = next(v for m, n, v in perturb.named_leaves(pp) if m == mod and n == leaf)
    assert np.array_equal(x, y) != mod.endswith("self_attn.q_proj"), mod


# --- scoring ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_scorer_is_the_exact_kl_of_mismatch(llama):
  """Same tokens, same formula as `mismatch.exact_kl` (temperature 0.8 on both sides)."""
  model, params, scorer = llama
  pp = sensitivity.perturbed(params, ["*"], "int8:channel", jax.random.key(0))
  batch = scorer.batch  # its loss_mask covers the completions only; exact_kl's covers the whole sequence
  mask = jnp.pad(batch["loss_mask"], ((0, 0), (batch["tokens"].shape[1] - batch["loss_mask"].shape[1], 0)))
  ref = masked_mean(exact_kl(model, pp, model, params, {**batch, "loss_mask": mask}, SP), mask)
  got = scorer.kl(pp)
  assert got > 1e-3  # the perturbation is visible
  np.testing.assert_allclose(got, float(ref), rtol=2e-5)
  assert scorer.kl(params) < 1e-6  # the clean floor (no top-k/top-p truncation here)
  assert scorer.kl(pp, params) != got  # the output-projection params are used
  # Per sequence (claim 2's paired interval over prompts): each row's token mean of the same KL.
  rows = scorer.kl_rows(pp)
  kl_BxL = np.asarray(exact_kl(model, pp, model, params, {**batch, "loss_mask": mask}, SP))
  m = np.asarray(mask, np.float64)
  np.testing.assert_allclose(rows, (kl_BxL * m).sum(-1) / np.maximum(m.sum(-1), 1), rtol=2e-5, atol=1e-8)
  assert rows.shape == (batch["tokens"].shape[0],) and np.ptp(rows) > 0  # the prompts differ


@pytest.mark.slow
def test_sweep_compiles_once(llama):
  model, params, scorer = llama
  key = jax.random.key(1)
  before = scorer.fn._cache_size()
  for p in ("fp8_e4m3:channel", "fp8_e5m2:channel", "int8:channel", "noise:0.05", "bf16"):
    for pattern in ("layers.0.*", "*.mlp.up_proj", "embed_tokens", "lm_head"):
      pp = sensitivity.perturbed(params, [pattern], p, key)
      assert scorer.kl(pp, params) > -1e-6  # a KL, up to fp32 rounding
  assert scorer.fn._cache_size() == max(before, 1) == 1


# --- recipe selection ---------------------------------------------------------------------------

def test_recipe_selection_arithmetic_on_a_synthetic_ranking():
  singles = [0.5, 4.0, 0.25, 2.0, 1.0]
  order = sensitivity.rank(singles)
  assert order == [1, 3, 4, 0, 2]
  assert sensitivity.rank([1.0, 2.0, 2.0, 0.0]) == [1, 2, 0, 3]
  seen = []

  def additive(keep):  # KL = floor + the quantized layers' single KLs (exact in binary)
    seen.append(list(keep))
    return 0.125 + sum(v for i, v in enumerate(singles) if i not in keep)

  k, curve, met = sensitivity.select_bf16_layers(order, additive, target=3.0)
  assert (k, met) == (2, True) and curve == {0: 7.875, 1: 3.875, 2: 1.875}
  assert seen == [[], [1], [1, 3]]
  assert sensitivity.select_bf16_layers(order, additive, target=1.875)[0] == 2  # <= target, inclusive
  assert sensitivity.select_bf16_layers(order, additive, target=7.875)[0] == 0
  k, curve, met = sensitivity.select_bf16_layers(order, additive, target=0.1)  # below the floor
  assert (k, met) == (5, False) and curve[5] == 0.125
  # Measured, not summed: here only keeping three layers helps at all.
  assert sensitivity.select_bf16_layers(order, lambda keep: 10.0 if len(keep) < 3 else 1.0, 2.0)[0] == 3


def test_edge_layers_are_the_presets_and_rows_make_an_engine_view():
  assert sensitivity.edge_layers(6, 0) == [] and sensitivity.edge_layers(6, 3) == [0, 1, 5]
  assert sensitivity.edge_layers(6, 6) == list(range(6))
  for e in (1, 2):
    preset = [p for p, f in perturb.preset("fp8", 6, e) if p.startswith("layers.")]
    assert [f"layers.{i}.*" for i in sensitivity.edge_layers(6, 2 * e)] == preset
  rows = sensitivity.recipe_rows([7, 3], "fp8_e4m3:channel", has_lm_head=False)
  spec = sensitivity.recipe_spec(rows)
  assert spec == "embed_tokens>bf16|layers.3.*>bf16|layers.7.*>bf16|*>fp8_e4m3:channel" and "," not in spec
  assert EngineView.parse("weights=" + spec).recipe(12) == rows


# --- the analysis on tiny models -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fixture,sensitive", [("llama", 1), ("qwen3_tied", 2)])
def test_recipe_keeps_the_sensitive_layer_and_beats_same_memory_choices(request, fixture, sensitive):
  """Llama-style and Qwen3-style (tied embeddings) models, each with a different deliberately sensitive
  layer: the ranking follows the model, and the recipe beats the edge layers at the same memory."""
  model, params, scorer = request.getfixturevalue(fixture)
  tied = model.cfg.tie_word_embeddings
  settings = Settings(perturbations=("fp8_e4m3:channel", "noise:0.05"))
  r = sensitivity.analyse(model, params, scorer, settings, progress=False)
  rec, base = r["recipe"], r["baselines"]
  assert r["ranking"]["layers"][0] == sensitive
  assert rec["target_met"] and rec["measured_kl"] <= rec["target_kl"] < rec["kl_all_quantized"]
  assert rec["bf16_layers"] == [sensitive]
  assert base["edge"]["bf16_layers"] == [0]
  assert rec["measured_kl"] < base["edge"]["kl"]
  assert rec["measured_kl"] <= base["random"]["kl"]
  assert r["compiles"] == 1
  # The recipe string is the same recipe: through an EngineView it gives the very same KL.
  view = EngineView.parse(rec["engine_view"])
  assert scorer.kl(view.transform(params, model.cfg.num_layers)) == rec["measured_kl"]
  kinds = {row["kind"]: row["fp8_e4m3:channel"] for row in r["kinds"]}
  if tied:  # the lookup and the projection of the one tensor, separately and together
    assert {"embed_tokens", "lm_head", "tied_embedding"} <= kinds.keys()
    assert len({kinds["embed_tokens"], kinds["lm_head"], kinds["tied_embedding"]}) == 3
    assert "lm_head" not in rec["weights"]
  assert all(v > 0 for v in kinds.values())


def test_mixed_recipe_params_equal_apply_recipe(llama):
  model, params, _ = llama
  rows = sensitivity.recipe_rows([0, 2], "int8:channel", has_lm_head=True)
  mixed = sensitivity._mix(perturb.apply_recipe(params, [("*", "bf16")]),
                           perturb.apply_recipe(params, sensitivity.recipe_rows([], "int8:channel", True)), [0, 2])
  direct = perturb.apply_recipe(params, rows)
  assert jax.tree.structure(mixed) == jax.tree.structure(direct)
  for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(direct)):
    assert np.array_equal(a, b)
  up = lambda t: t["layers"]["mlp"]["up_proj"]["kernel"]
  assert not np.array_equal(up(direct)[1], up(params)[1])  # quantized
  assert np.array_equal(up(direct)[2], up(params)[2].astype(jnp.bfloat16).astype(jnp.float32))  # kept in bf16


def test_compare_rankings():
  def res(vals):
    return {"settings": {"perturbations": ["p"]}, "kinds": [{"kind": k, "p": v} for k, v in vals.items()],
            "ranking": {"kinds": sorted(vals, key=lambda k: -vals[k])}}

  a = res({"q_proj": 1.0, "k_proj": 2.0, "v_proj": 3.0})
  same = sensitivity.compare(a, res({"q_proj": 10.0, "k_proj": 20.0, "v_proj": 30.0, "x": 0.0}))
  assert same["kinds"] == ["q_proj", "k_proj", "v_proj"] and same["spearman"]["p"] == pytest.approx(1)
  reverse = sensitivity.compare(a, res({"q_proj": 3.0, "k_proj": 2.0, "v_proj": 1.0}))
  assert reverse["spearman"]["p"] == pytest.approx(-1)
  assert sensitivity.spearman([1, 1, 1], [1, 2, 3]) is None


# --- configuration and the command line --------------------------------------------------------

@pytest.mark.parametrize("key,value,match", [
    ("model", "critic", "choose 'teacher' or 'student'"),
    ("formats", "fp8_e4m3,fp9", "unknown weight format"),
    ("formats", "int8:row", "unknown scale granularity"),
    ("recipe_format", "bf16", "the recipe quantizes to one of"),
    ("noise_sigma", -0.1, ">= 0"),
])
def test_bad_settings_are_user_errors(key, value, match):
  sc = ml_collections.ConfigDict(default_config().sensitivity.to_dict())
  sc[key] = value
  with pytest.raises(UserError, match=match):
    Settings.from_config(sc)


def test_settings_from_the_default_config():
  s = Settings.from_config(default_config().sensitivity)
  assert s.perturbations == ("fp8_e4m3:channel", "fp8_e5m2:channel", "int8:channel", "noise:0.05")
  assert s.recipe_format == "fp8_e4m3:channel"


def test_cli_rejects_bad_input_before_loading(tmp_path, capsys):
  assert cli.main(["sensitivity", "--out", str(tmp_path), "--config.sensitivity.model=critic"]) == 2
  assert "sensitivity.model='critic'; choose one of 'teacher', 'student'" in capsys.readouterr().err
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_cli_end_to_end(demo_cache, tmp_path, capsys):
  out = str(tmp_path / "sens")
  # A quickly trained demo teacher (its own cache entry): the analysis, not the model, is under test.
  assert cli.main(["sensitivity", "--out", out, "--config.sensitivity.num_prompts=8",
                   "--config.sensitivity.formats=fp8_e4m3,int8", "--config.teacher.sft_steps=20",
                   "--config.teacher.hidden_size=32"]) == 0
  printed = capsys.readouterr().out
  files = set(os.listdir(out))
  assert {"sensitivity.json", "sensitivity.csv", "sensitivity.md", "recipe.json", "recipe_view.txt",
          "recipe_curve.csv", "sensitivity.png", "sensitivity_recipe.png"} <= files
  for png in ("sensitivity.png", "sensitivity_recipe.png"):
    with open(os.path.join(out, png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with open(os.path.join(out, "recipe.json")) as f:
    recipe = json.load(f)
  view = EngineView.parse(recipe["engine_view"])  # the written view is usable as rollout.view
  assert view.recipe(2) == [tuple(r) for r in recipe["recipe"]]
  assert recipe["measured_kl"] <= recipe["target_kl"] or not recipe["target_met"]
  with open(os.path.join(out, "sensitivity.csv")) as f:
    lines = f.read().splitlines()
  assert lines[0] == "scope,name,perturbation,exact_kl,rank"
  assert len(lines) == 1 + 3 * (2 + 9)  # (recipe format + int8 + noise) x (2 layers + 9 kinds)
  with open(os.path.join(out, "sensitivity.json")) as f:
    assert json.load(f)["compiles"] == 1
  assert recipe["engine_view"] in printed and "most sensitive layers" in printed
