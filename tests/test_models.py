"""Decoder parity with transformers' PyTorch models, both load and save directions."""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import log_softmax
from safetensors import safe_open

from opdjax.models import Model, ModelConfig, UnsupportedModelError, load_hf_params, save_hf_params

MAX_ABS = 1e-4
MAX_KL = 1e-6
ROPE_THETA = 500.0  # not the default, so a config parser that ignores it shows
# Small enough to build in milliseconds; rms_norm_eps and special ids are not HF's defaults.
TINY_HF = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

# hidden 32 over 4 heads is 8: head_dim 12 and 6 exercise head_dim != hidden / heads.
CASES = {
    "llama-headdim12-bias-untied": dict(model_type="llama", head_dim=12, bias=True, mlp_bias=True, tie=False),
    "llama-tied-mqa": dict(model_type="llama", head_dim=8, bias=False, mlp_bias=False, tie=True, kv=1),
    "qwen2-untied": dict(model_type="qwen2", head_dim=8, tie=False),
    "qwen2-headdim12-tied": dict(model_type="qwen2", head_dim=12, tie=True),
    "qwen3-headdim12-untied": dict(model_type="qwen3", head_dim=12, bias=False, tie=False),
    "qwen3-headdim6-bias-tied-mha": dict(model_type="qwen3", head_dim=6, bias=True, tie=True, kv=4),
}


def hf_config(spec):
  kw = dict(TINY_HF, head_dim=spec["head_dim"], tie_word_embeddings=spec["tie"], rope_theta=ROPE_THETA,
            num_key_value_heads=spec.get("kv", 2))
  if spec["model_type"] in ("llama", "qwen3"):
    kw["attention_bias"] = spec["bias"]
  if spec["model_type"] == "llama":
    kw["mlp_bias"] = spec["mlp_bias"]
  return kw


def expected_config(spec):
  """The ModelConfig each case should parse to, written out from the HF families' definitions."""
  mt = spec["model_type"]
  return ModelConfig(
      model_type=mt, vocab_size=TINY_HF["vocab_size"], hidden_size=TINY_HF["hidden_size"],
      intermediate_size=TINY_HF["intermediate_size"], num_layers=TINY_HF["num_hidden_layers"],
      num_heads=TINY_HF["num_attention_heads"], num_kv_heads=spec.get("kv", 2),
      head_dim=spec["head_dim"], rope_theta=ROPE_THETA, rms_norm_eps=TINY_HF["rms_norm_eps"],
      tie_word_embeddings=spec["tie"],
      attention_bias=True if mt == "qwen2" else spec["bias"],  # Qwen2 always has q/k/v bias
      o_proj_bias=spec.get("bias", False) if mt != "qwen2" else False,
      mlp_bias=spec.get("mlp_bias", False), qk_norm=mt == "qwen3",
      max_position_embeddings=TINY_HF["max_position_embeddings"],
      bos_token_id=TINY_HF["bos_token_id"], eos_token_id=TINY_HF["eos_token_id"],
      pad_token_id=TINY_HF["pad_token_id"])


def padded_batch(rng, vocab):
  """Row 0 full, row 1 left-padded by 3; positions restart at 0 on each row's first real token."""
  tokens = rng.integers(3, vocab, (2, 7)).astype(np.int32)
  mask = np.ones((2, 7), np.int32)
  mask[1, :3] = 0
  tokens[1, :3] = 0
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def hf_logits(model, tokens, mask, positions):
  import torch
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
                position_ids=torch.from_numpy(positions).long())
  return out.logits.float().numpy()


@functools.lru_cache
def _jit_apply(cfg):
  return jax.jit(Model(cfg).apply)


def jax_logits(cfg, params, tokens, mask, positions):
  logits, _ = _jit_apply(cfg)(params, tokens, positions, mask)
  assert logits.dtype == jnp.float32
  return np.asarray(logits)


def divergence(a, b, mask):
  """(max |a - b|, mean KL(softmax a || softmax b)) over real positions, in float64."""
  real = mask.astype(bool)
  a, b = a[real].astype(np.float64), b[real].astype(np.float64)
  la, lb = log_softmax(a), log_softmax(b)
  kl = np.sum(np.exp(la) * (la - lb), axis=-1)
  return float(np.max(np.abs(a - b))), float(np.mean(kl))


def assert_parity(a, b, mask):
  diff, kl = divergence(a, b, mask)
  assert diff <= MAX_ABS, f"max |logit diff| = {diff}"
  assert kl <= MAX_KL, f"mean KL = {kl}"
  # Guard against a vacuous pass: logits must be informative (not constant across the vocab).
  assert np.std(a[mask.astype(bool)], axis=-1).min() > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_load_hf_matches_transformers(name, make_hf_model):
  spec = CASES[name]
  seed = list(CASES).index(name)
  hf, path = make_hf_model(spec["model_type"], seed=seed, **hf_config(spec))
  cfg = ModelConfig.from_pretrained(path)
  assert cfg == expected_config(spec)
  params = load_hf_params(str(path))
  tokens, mask, positions = padded_batch(np.random.default_rng(seed), cfg.vocab_size)
  ref = hf_logits(hf, tokens, mask, positions)
  got = jax_logits(cfg, params, tokens, mask, positions)
  assert_parity(ref, got, mask)

  # The comparison has power: one changed weight puts it far past the threshold.
  bumped = jax.tree.map(lambda x: x, params)
  bumped["layers"]["self_attn"]["v_proj"]["kernel"] = (
      params["layers"]["self_attn"]["v_proj"]["kernel"].at[1, 3, 5].add(0.2))
  assert divergence(ref, jax_logits(cfg, bumped, tokens, mask, positions), mask)[0] > 10 * MAX_ABS


@pytest.mark.parametrize("name", list(CASES))
def test_save_hf_loads_in_transformers(name, tmp_path, random_params):
  import torch
  import transformers
  spec = CASES[name]
  cfg = expected_config(spec)
  seed = 10 + list(CASES).index(name)
  # Model.init's tree with random values: norms away from one, biases away from zero.
  params = random_params(Model(cfg), seed=seed)
  path = str(tmp_path / "saved")
  save_hf_params(params, cfg, path)
  assert ModelConfig.from_pretrained(path) == cfg
  hf, info = transformers.AutoModelForCausalLM.from_pretrained(
      path, output_loading_info=True, attn_implementation="eager")
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
  assert hf.dtype == torch.float32
  hf.eval()
  tokens, mask, positions = padded_batch(np.random.default_rng(seed), cfg.vocab_size)
  got = jax_logits(cfg, params, tokens, mask, positions)
  assert_parity(got, hf_logits(hf, tokens, mask, positions), mask)

  with torch.no_grad():
    hf.model.layers[0].mlp.down_proj.weight[4, 7] += 0.2
  assert divergence(got, hf_logits(hf, tokens, mask, positions), mask)[0] > 10 * MAX_ABS


def test_sharded_checkpoint_loads_like_single_file(make_hf_model):
  spec = CASES["qwen3-headdim12-untied"]
  _, single = make_hf_model("qwen3", seed=5, **hf_config(spec))
  _, sharded = make_hf_model("qwen3", seed=5, save_kw=dict(max_shard_size="20KB"), **hf_config(spec))
  shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
  assert len(shards) > 2 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  a, b = load_hf_params(str(single)), load_hf_params(str(sharded))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Every tensor the config has was read: 3 top-level + 11 stacked per-layer leaves (4 proj, 2 qk norms,
  # 2 norms, 3 mlp), each holding every layer.
  assert len(jax.tree.leaves(b)) == 3 + 11
  assert all(x.shape[0] == TINY_HF["num_hidden_layers"] for x in jax.tree.leaves(b["layers"]))


def test_unknown_model_type_is_rejected(tmp_path):
  import transformers
  transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50).save_pretrained(tmp_path)
  with pytest.raises(UnsupportedModelError, match="gpt2"):
    ModelConfig.from_pretrained(tmp_path)
  with pytest.raises(UnsupportedModelError, match="gpt2"):
    load_hf_params(str(tmp_path))


def test_a_folder_another_process_writes_meanwhile_is_kept_and_ours_cleaned_up(tmp_path, random_params,
                                                                               monkeypatch):
  """Two processes building one cache entry (the demo models of two trainer processes): the one that
  renames second gets FileExistsError (the cache's "use the other copy"), the first's folder stays."""
  from opdjax.models import hf_io

  cfg = expected_config(CASES["qwen2-untied"])
  params = random_params(Model(cfg), seed=0)
  target = tmp_path / "out"
  save_file = hf_io.save_file

  def other_process_finishes_first(tensors, filename, metadata=None):
    if not target.exists():
      monkeypatch.setattr(hf_io, "save_file", save_file)
      hf_io.save_hf_params(params, cfg, str(target))
    save_file(tensors, filename, metadata=metadata)

  monkeypatch.setattr(hf_io, "save_file", other_process_finishes_first)
  with pytest.raises(FileExistsError, match="written by another process meanwhile"):
    hf_io.save_hf_params(params, cfg, str(target))
  assert sorted(os.listdir(tmp_path)) == ["out"] and sorted(os.listdir(target)) == ["config.json", "model.safetensors"]


def test_save_refuses_non_empty_folder_and_leaves_it_untouched(tmp_path, random_params):
  cfg = expected_config(CASES["qwen2-untied"])
  params = random_params(Model(cfg), seed=0)
  target = tmp_path / "out"
  target.mkdir()
  (target / "notes.txt").write_text("keep me")
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(FileExistsError):
    save_hf_params(params, cfg, str(target))
  assert os.listdir(target) == ["notes.txt"] and (target / "notes.txt").read_text() == "keep me"
  assert sorted(os.listdir(tmp_path)) == before  # no temporary folder left behind

  empty = tmp_path / "empty"
  empty.mkdir()
  save_hf_params(params, cfg, str(empty))  # an existing empty folder is fine
  assert sorted(os.listdir(empty)) == ["config.json", "model.safetensors"]
  with open(empty / "config.json") as f:
    assert json.load(f)["model_type"] == "qwen2"


@pytest.mark.slow
def test_kv_cache_decode_matches_full_forward(random_params):
  """Prefill 3 tokens, then decode the rest one at a time; logits equal one full pass."""
  cfg = expected_config(CASES["qwen3-headdim6-bias-tied-mha"]).replace(num_kv_heads=2)
  model = Model(cfg)
  params = random_params(model, seed=1, std=0.4)
  rng = np.random.default_rng(3)
  tokens, mask, positions = padded_batch(rng, cfg.vocab_size)
  mask[1, :4] = 0  # row 1's first real token arrives during decode, not prefill
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  b, t = tokens.shape
  full = jax_logits(cfg, params, tokens, mask, positions)

  prefill, slots = 3, t + 2  # spare slots at the end must be ignored
  kv_mask = np.zeros((b, slots), np.int32)
  kv_mask[:, :prefill] = mask[:, :prefill]
  cache = model.init_cache(b, slots)
  apply = jax.jit(model.apply)
  logits, cache = apply(params, tokens[:, :prefill], positions[:, :prefill], kv_mask, cache)
  steps = [np.asarray(logits)]
  for i in range(prefill, t):
    kv_mask[:, i] = mask[:, i]
    logits, cache = apply(params, tokens[:, i:i + 1], positions[:, i:i + 1], kv_mask, cache)
    steps.append(np.asarray(logits))
  assert int(cache["index"]) == t
  cached = np.concatenate(steps, axis=1)
  real = mask.astype(bool)
  np.testing.assert_allclose(cached[real], full[real], atol=1e-5, rtol=1e-5)

  # The cache carries the context: decoding the last token against an empty cache differs.
  empty = {**model.init_cache(b, slots), "index": jnp.asarray(t - 1, jnp.int32)}
  alone, _ = apply(params, tokens[:, -1:], positions[:, -1:], kv_mask, empty)
  assert np.max(np.abs(np.asarray(alone)[:, 0] - full[:, -1])) > 1e-2


def test_bf16_checkpoint_loads_as_float32(make_hf_model, tmp_path):
  spec = CASES["qwen2-untied"]
  hf, _ = make_hf_model("qwen2", seed=7, **hf_config(spec))
  hf = hf.bfloat16()
  hf.save_pretrained(tmp_path / "bf16")
  with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "np") as f:
    assert f.get_slice("model.norm.weight").get_dtype() == "BF16"  # the file really is bf16
  params = load_hf_params(str(tmp_path / "bf16"))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  want = hf.model.layers[0].self_attn.q_proj.weight.float().detach().numpy().T  # HF stores [out, in]
  np.testing.assert_array_equal(np.asarray(params["layers"]["self_attn"]["q_proj"]["kernel"][0]), want)


FAMILY_DIMS = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                   head_dim=8)
# Switches left out take the family's own (what its transformers class builds), so the config saves
# and loads back: (given, switches it ends up with).
FAMILY_DEFAULTS = {
    "qwen3-without-qk-norm": (dict(model_type="qwen3"), dict(attention_bias=False, o_proj_bias=False, qk_norm=True)),
    "qwen2-without-qkv-bias": (dict(model_type="qwen2"), dict(attention_bias=True, o_proj_bias=False, qk_norm=False)),
    "llama-qkv-bias-without-o-bias": (dict(model_type="llama", attention_bias=True),
                                      dict(attention_bias=True, o_proj_bias=True, qk_norm=False)),
}
# Switches the family cannot express: refused where the config is built, with the switches it can.
FAMILY_MISMATCHES = {
    "qwen3-qk-norm-off": (dict(model_type="qwen3", qk_norm=False), "(False, False, True)"),
    "qwen2-o-bias": (dict(model_type="qwen2", o_proj_bias=True), "(True, False, False)"),
    "llama-o-bias-only": (dict(model_type="llama", attention_bias=False, o_proj_bias=True), "(False, False, False)"),
}


@pytest.mark.parametrize("name", list(FAMILY_DEFAULTS))
def test_switches_left_out_take_the_familys_and_survive_the_round_trip(name, tmp_path, random_params):
  given, switches = FAMILY_DEFAULTS[name]
  cfg = ModelConfig(**FAMILY_DIMS, **given)
  assert {k: getattr(cfg, k) for k in switches} == switches
  save_hf_params(random_params(Model(cfg), seed=0), cfg, str(tmp_path / "out"))
  assert ModelConfig.from_pretrained(tmp_path / "out") == cfg


@pytest.mark.parametrize("name", list(FAMILY_MISMATCHES))
def test_config_a_family_cannot_express_is_refused_where_it_is_built(name):
  given, allowed = FAMILY_MISMATCHES[name]
  family = given["model_type"]
  with pytest.raises(UnsupportedModelError, match=re.escape(f"{family} cannot express ") + ".*"
                     + re.escape(f"For {family} use attention_bias/o_proj_bias/qk_norm = {allowed}")):
    ModelConfig(**FAMILY_DIMS, **given)


# --- scanned layers -----------------------------------------------------------------------------

def _scan_cfg(layers):
  return expected_config(CASES["qwen3-headdim6-bias-tied-mha"]).replace(num_layers=layers, num_kv_heads=2)


@pytest.mark.slow
def test_scanned_layers_equal_the_layers_applied_one_by_one(random_params):
  """The scan over stacked params is the unrolled loop: layer i's slice applied to layer i - 1's output."""
  from opdjax.models.decoder import DecoderLayer

  cfg = _scan_cfg(3)
  model = Model(cfg)
  params = random_params(model, seed=4, std=0.3)
  assert params["layers"]["mlp"]["down_proj"]["kernel"].shape == (3, cfg.intermediate_size, cfg.hidden_size)
  tokens, mask, positions = padded_batch(np.random.default_rng(4), cfg.vocab_size)
  got, _ = model.hidden(params, tokens, positions, mask)

  def unrolled(order):
    x = params["embed_tokens"]["embedding"][tokens]
    for i in order:
      layer = jax.tree.map(lambda a, i=i: a[i], params["layers"])
      x, _ = DecoderLayer(cfg).apply({"params": layer}, x, i, positions, mask)
    w = params["norm"]["weight"]
    return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)

  np.testing.assert_allclose(np.asarray(got), np.asarray(unrolled([0, 1, 2])), atol=1e-5, rtol=1e-5)
  # The layers differ, so applying the slices in another order is visibly another model.
  assert float(jnp.max(jnp.abs(got - unrolled([2, 1, 0])))) > 1e-2


def _dot_count(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_traced_program_does_not_grow_with_depth():
  """One scan body whatever the depth: the forward and the remat backward trace the same number of
  matmuls for 1 and 6 layers (an unrolled decoder has 6x as many). The engine's decode step is
  unrolled on purpose (per-layer weights and cache, opdjax.models.inference): one projection set per layer."""
  tokens = jnp.zeros((2, 5), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  mask = jnp.ones((2, 5), jnp.int32)
  counts = []
  for layers in (1, 6):
    model = Model(_scan_cfg(layers), remat_policy="full")
    params = jax.eval_shape(model.init, jax.random.key(0))
    cache = jax.eval_shape(lambda m=model: m.init_cache(2, 8))
    assert [x["k"].shape for x in cache["layers"]] == [(2, 2, 8, 6)] * layers
    counts.append((
        _dot_count(lambda p, m=model: m.apply(p, tokens, positions, mask), params),
        _dot_count(jax.grad(lambda p, m=model: m.apply(p, tokens, positions, mask)[0].sum()), params),
        _dot_count(lambda p, c, m=model: m.apply(p, tokens[:, :1], positions[:, :1], jnp.ones((2, 8)), c), params,
                   cache)))
  assert counts[0][:2] == counts[1][:2], counts
  assert min(counts[0][:2]) >= 10  # 7 projections + 2 attention einsums + the logits, at least
  # Decode: 6 dots a layer (fused q|k|v, two attention einsums, o, fused gate|up, down) + the logits.
  assert [c[2] for c in counts] == [6 + 1, 6 * 6 + 1], counts


@pytest.mark.slow
def test_remat_policies_change_what_is_recomputed_not_the_gradient(random_params):
  tokens = jnp.asarray(np.random.default_rng(5).integers(3, 61, (2, 6)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  mask = jnp.ones((2, 6), jnp.int32)
  params = random_params(Model(_scan_cfg(2)), seed=5, std=0.3)
  grads, dots = [], []
  for policy in ("nothing", "dots", "full"):
    model = Model(_scan_cfg(2), remat_policy=policy)
    loss = lambda p, m=model: jnp.mean(jax.nn.log_softmax(m.apply(p, tokens, positions, mask)[0])[..., 0])
    grads.append(jax.jit(jax.grad(loss))(params))
    dots.append(_dot_count(jax.grad(loss), params))
  # More recomputation, more matmuls in the backward: the policy really is applied.
  assert dots[0] < dots[1] < dots[2], dots
  for g in grads[1:]:
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(g), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
  assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads[0])) > 1e-3


def test_unknown_remat_policy_is_a_clear_error():
  from opdjax.errors import UserError

  with pytest.raises(UserError, match="remat_policy='everything'.*nothing, dots, full"):
    Model(_scan_cfg(1), remat_policy="everything")
