"""The KV-capacity planner: its arithmetic by hand, its shapes against opdjax's and transformers'
models, the CLI, and its KV accounting against vLLM's own (`get_kv_cache_configs`, no engine)."""

import json
import math
from fractions import Fraction

import jax
import pytest

from opdjax.analyses import capacity
from opdjax.analyses.capacity import GIB, capacity_for_view, kv_blocks, kv_bytes_per_token, weight_footprint
from opdjax.cli import main as cli_main
from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.views import perturb
from opdjax.views.view import EngineView

# 2 layers, 2 query heads sharing 1 KV head of 32, untied: small enough to count by hand.
SHAPE = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
             num_kv_heads=1, head_dim=32)
SMALL = ModelConfig(**SHAPE)


# --- KV bytes ----------------------------------------------------------------------------------

def test_kv_bytes_per_token_by_hand():
  cfg = SMALL.replace(num_layers=4, num_heads=8, num_kv_heads=2)
  # per layer: keys + values = 2 * 2 kv heads * 32 = 128 elements; GQA: the 8 query heads do not count
  assert kv_bytes_per_token(cfg) == 4 * 128 * 2
  assert kv_bytes_per_token(cfg, "fp8") == 4 * 128 * 1
  assert kv_bytes_per_token(cfg, "fp8", [0]) == 128 * 2 + 3 * 128 * 1
  assert kv_bytes_per_token(cfg, "fp8", [0, 3]) == 2 * 256 + 2 * 128
  assert kv_bytes_per_token(cfg.replace(num_kv_heads=8)) == 4 * kv_bytes_per_token(cfg)
  assert kv_bytes_per_token(cfg, "bf16", [0]) == kv_bytes_per_token(cfg)  # exclusions only matter for fp8


def test_one_bf16_layer_of_28_gives_2x28_over_29():
  _, cfg = capacity.load_model_config("qwen3-1.7b")
  assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (28, 8, 128)
  assert kv_bytes_per_token(cfg) == 28 * 2 * 8 * 128 * 2
  ratio = Fraction(kv_bytes_per_token(cfg), kv_bytes_per_token(cfg, "fp8", [27]))
  assert ratio == Fraction(2 * 28, 29) and float(ratio) > 1.93
  # In tokens, with the same weights, block rounding is the only difference from that ratio.
  base, fp8 = (capacity.plan(cfg, None, kv, [27], 72.0, 3.6) for kv in ("bf16", "fp8"))
  assert base["kv_available_gib"] == fp8["kv_available_gib"]
  assert abs(fp8["kv_tokens"] / base["kv_tokens"] - float(ratio)) < 2 * 16 / base["kv_tokens"] * float(ratio)


def test_blocks_round_down_like_vllm():
  assert kv_blocks(10 * 16 * 100 - 1, 100, 16) == 9
  assert kv_blocks(10 * 16 * 100, 100, 16) == 10
  assert kv_blocks(-5, 100, 16) == 0
  out = capacity.plan(SMALL, None, "bf16", (), memory_gib=1.0, reserve_gib=0.25, block_size=16)
  per_token = 2 * 2 * 32 * 2  # 2 layers x (k + v) x 1 kv head x 32 x bf16
  assert out["kv_bytes_per_token"] == per_token
  assert out["kv_blocks"] == (GIB - GIB // 4 - 2 * 106816) // (16 * per_token)
  assert out["kv_tokens"] == 16 * out["kv_blocks"]


# --- weights -----------------------------------------------------------------------------------

def test_weight_bytes_by_hand():
  # embed 256*64; per layer q 64*64, k 64*32, v 64*32, o 64*64, gate/up 64*128, down 128*64, 2 norms of 64;
  # final norm 64; lm_head 64*256.
  layer_mats = 4096 + 2048 + 2048 + 4096 + 3 * 8192
  assert layer_mats == 36864
  params = 16384 + 2 * (layer_mats + 128) + 64 + 16384
  assert capacity.param_count(SMALL) == params == 106816
  assert weight_footprint(SMALL) == {"params": params, "quantized_params": 0, "scale_bytes": 0, "bytes": 2 * params}
  # fp8 preset: every projection 1 byte + one fp32 scale per output column (64+32+32+64+128+128+64 = 512);
  # embeddings, lm_head and norms bf16.
  fp8 = weight_footprint(SMALL, perturb.preset("fp8", 2, keep_edge_layers=0))
  assert fp8["scale_bytes"] == 2 * 512 * 4
  assert fp8["bytes"] == 2 * (layer_mats + 512 * 4 + 128 * 2) + 2 * (16384 + 64 + 16384) == 144000
  # per-tensor scales: 7 a layer; 128x128 blocks: these matrices are all one tile each
  tensor = weight_footprint(SMALL, [("embed_tokens", "bf16"), ("lm_head", "bf16"), ("*", "fp8_e4m3:tensor")])
  block = weight_footprint(SMALL, [("embed_tokens", "bf16"), ("lm_head", "bf16"), ("*", "fp8_e4m3:block")])
  assert tensor["scale_bytes"] == block["scale_bytes"] == 2 * 7 * 4
  # keep_edge_layers=1 of 2 layers keeps everything bf16: the same bytes as the bf16 baseline
  assert weight_footprint(SMALL, perturb.preset("fp8", 2, keep_edge_layers=1))["bytes"] == 2 * params


def test_block_scale_counts():
  assert capacity._num_scales((128, 128), "block") == 1
  assert capacity._num_scales((129, 1), "block") == 2
  assert capacity._num_scales((300, 200), "block") == 3 * 2
  assert capacity._num_scales((300, 200), "channel") == 200
  assert capacity._num_scales((300, 200), "tensor") == 1
  cfg = SMALL.replace(intermediate_size=300)  # gate/up 64x300: 3 tiles; down 300x64: 3 tiles
  block = weight_footprint(cfg, [("layers.*.mlp.*", "int8:block")])
  assert block["scale_bytes"] == 2 * (3 + 3 + 3) * 4
  assert block["quantized_params"] == 2 * 3 * 64 * 300


def test_tied_embeddings_counted_once_and_presets_still_apply():
  tied = SMALL.replace(tie_word_embeddings=True)
  assert capacity.param_count(SMALL) - capacity.param_count(tied) == 64 * 256
  fp8 = weight_footprint(tied, perturb.preset("fp8", 2, keep_edge_layers=0))  # names lm_head, which is tied
  assert fp8["bytes"] == 144000 - 2 * 64 * 256


def test_recipe_pattern_that_matches_nothing_is_an_error():
  with pytest.raises(UserError, match="matches nothing"):
    weight_footprint(SMALL, [("layers.9.*", "fp8_e4m3")])
  with pytest.raises(UserError, match="unknown weight format"):
    weight_footprint(SMALL, [("*", "fp4")])


@pytest.mark.parametrize("cfg", [
    SMALL,
    ModelConfig(**{**SHAPE, "model_type": "qwen2", "tie_word_embeddings": True}),
    ModelConfig(**{**SHAPE, "model_type": "qwen3", "attention_bias": True}),
    SMALL.replace(attention_bias=True, o_proj_bias=True, mlp_bias=True),
], ids=["llama", "qwen2-tied", "qwen3-bias", "llama-biases"])
def test_shapes_are_opdjax_models_params(cfg):
  params = jax.eval_shape(Model(cfg).init, jax.random.key(0))
  theirs = sorted((m, leaf, tuple(x.shape)) for m, leaf, x in perturb.named_leaves(params))
  assert sorted(capacity.tensor_shapes(cfg)) == theirs


@pytest.mark.parametrize("model_type,hf", [
    ("qwen3", dict(tie_word_embeddings=False)),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("llama", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
])
def test_param_count_matches_transformers(make_hf_model, model_type, hf):
  hf_model, path = make_hf_model(model_type, vocab_size=320, hidden_size=96, intermediate_size=160,
                                 num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                 **hf)
  _, cfg = capacity.load_model_config(str(path))
  assert capacity.param_count(cfg) == sum(p.numel() for p in hf_model.parameters())


def test_known_shapes_have_their_published_sizes():
  counts = {name: capacity.param_count(capacity.load_model_config(name)[1]) for name in capacity.KNOWN_SHAPES}
  # Model cards: Qwen3-0.6B 0.6B (0.44B non-embedding), 1.7B (1.4B), 8B 8.2B (6.95B); Llama-3.1-8B 8.0B.
  assert round(counts["qwen3-0.6b"] / 1e8) == 6
  assert round(counts["qwen3-1.7b"] / 1e8) == 17
  assert round(counts["qwen3-8b"] / 1e8) == 82
  assert round(counts["llama-3.1-8b"] / 1e8) == 80
  assert round(counts["qwen2.5-7b"] / 1e8) == 76
  assert round(counts["qwen2.5-1.5b"] / 1e8) == 15


# --- recipes -----------------------------------------------------------------------------------

def test_recipe_from_spec_preset_and_files(tmp_path):
  assert capacity.load_recipe("bf16", 2) is None
  assert capacity.load_recipe("fp8", 4, keep_edge_layers=1) == perturb.preset("fp8", 4, 1)
  spec = "layers.0.*>bf16|*_proj>fp8_e4m3:block"
  assert capacity.load_recipe(spec, 2) == [("layers.0.*", "bf16"), ("*_proj", "fp8_e4m3:block")]
  sens = tmp_path / "recipe.json"
  sens.write_text(json.dumps({"recipe": [["layers.0.*", "bf16"], ["*", "fp8_e4m3:channel"]], "kl": 0.01}))
  assert capacity.load_recipe(str(sens), 2) == [("layers.0.*", "bf16"), ("*", "fp8_e4m3:channel")]
  text = tmp_path / "recipe.txt"
  text.write_text("# keep layer 0\nlayers.0.*>bf16\n*>int8\n")
  assert capacity.load_recipe(str(text), 2) == [("layers.0.*", "bf16"), ("*", "int8")]
  view = tmp_path / "recipe_view.txt"
  view.write_text("weights=layers.1.*>bf16|*>fp8_e4m3:channel\n")
  assert capacity.load_recipe(str(view), 2) == [("layers.1.*", "bf16"), ("*", "fp8_e4m3:channel")]
  with pytest.raises(UserError, match="unknown recipe preset"):
    capacity.load_recipe("fp9", 2)


# --- the API other modules call ----------------------------------------------------------------

def test_capacity_for_view():
  _, cfg = capacity.load_model_config("qwen3-1.7b")
  clean = capacity_for_view(cfg, EngineView(), 72.0)
  assert clean["kv_tokens_ratio"] == 1.0
  assert clean["weight_gib"] == capacity.param_count(cfg) * 2 / GIB
  assert capacity_for_view(cfg, EngineView(weights="bf16"), 72.0)["kv_tokens"] == clean["kv_tokens"]
  kv8 = capacity_for_view(cfg, EngineView(kv_quant="fp8_e4m3"), 72.0)
  assert kv8["kv_bytes_per_token"] * 2 == clean["kv_bytes_per_token"]
  both = capacity_for_view(cfg, EngineView(weights="fp8", kv_quant="fp8_e5m2"), 72.0, reserve_gib=3.6)
  assert both["weight_gib"] < 0.6 * clean["weight_gib"]
  assert 2.0 < both["kv_tokens_ratio"] < 2.1 and kv8["kv_tokens_ratio"] <= 2.0
  assert {"weight_gib", "kv_bytes_per_token", "kv_tokens", "kv_tokens_ratio"} <= set(both)
  with pytest.raises(UserError, match="needs at least"):
    capacity_for_view(cfg, EngineView(), 3.0)


# --- CLI ---------------------------------------------------------------------------------------

def test_cli_table_and_json(tmp_path, capsys):
  folder = tmp_path / "model"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(SMALL.to_hf_dict()))
  out = tmp_path / "out"
  rc = cli_main(["kv-capacity", "--model", str(folder), "--memory-gib", "0.01", "--reserve-gib", "0",
                 "--recipe", "fp8", "--kv-bf16-layers", "1", "--out", str(out), "--json", str(tmp_path / "r.json")])
  assert rc == 0
  text = capsys.readouterr().out
  assert "fp8 (bf16 layers 1)" in text and "ratio" in text
  result = json.loads((out / "kv_capacity.json").read_text())
  assert result == json.loads((tmp_path / "r.json").read_text())
  rows = {(r["weights"], r["kv"]): r for r in result["rows"]}
  assert len(rows) == 4 and result["kv_bytes_ratio"] == 256 / 192
  mem = int(0.01 * GIB)
  for (w, kv), r in rows.items():
    per_token = 256 if kv == "bf16" else 128 + 64  # layer 1 bf16, layer 0 fp8
    weights = 2 * 106816 if w == "bf16" else 144000
    assert (r["weight_bytes"], r["kv_bytes_per_token"]) == (weights, per_token)
    assert r["kv_tokens"] == 16 * ((mem - weights) // (16 * per_token))
  both = rows[("fp8", "fp8 (bf16 layers 1)")]
  assert both["kv_tokens_ratio"] == both["kv_tokens"] / rows[("bf16", "bf16")]["kv_tokens"] > 256 / 192


def test_cli_help_lists_the_flags(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli_main(["kv-capacity", "--help"])
  assert exit_.value.code == 0
  text = capsys.readouterr().out
  assert all(flag in text for flag in ("--memory-gib", "--reserve-gib", "--recipe", "--kv-bf16-layers", "--json"))


@pytest.mark.parametrize("args,message", [
    (["--model", "qwen3-1.7b", "--memory-gib", "72", "--kv-bf16-layers", "28"], "out of range: the model has 28"),
    (["--model", "qwen-99b", "--memory-gib", "72"], "qwen3-1.7b"),
    (["--model", "qwen3-8b", "--memory-gib", "8"], "the smallest configuration needs 9.19 GiB"),
    (["--model", "qwen3-1.7b", "--memory-gib", "72", "--recipe", "*>fp8_e4m3|bad"], "is not 'pattern>format'"),
    (["--model", "{tmp}/partial.json", "--memory-gib", "72"], "not a usable Hugging Face config"),
    (["--model", "{tmp}/list.json", "--memory-gib", "72"], "is not a Hugging Face config"),
    (["--model", "qwen3-1.7b", "--memory-gib", "72", "--json", "{tmp}/file.txt/x.json"], "pass a writable"),
])
def test_cli_bad_input_is_one_line_error(args, message, capsys, tmp_path):
  (tmp_path / "partial.json").write_text('{"model_type": "llama", "hidden_size": 64}')
  (tmp_path / "list.json").write_text("[1, 2]")
  (tmp_path / "file.txt").write_text("a file where a folder is needed")
  assert cli_main(["kv-capacity", *[a.replace("{tmp}", str(tmp_path)) for a in args]]) == 2
  err = capsys.readouterr().err
  assert err.startswith("opdjax: error:") and message in err and len(err.strip().splitlines()) == 1


# --- vLLM's own accounting ---------------------------------------------------------------------

@pytest.mark.vllm
def test_kv_accounting_matches_vllm(tmp_path, monkeypatch):
  """vLLM's `get_kv_cache_configs` on the per-layer specs its Attention layers build (without an
  engine): page bytes and block counts for bf16, fp8 and fp8 with a skipped (bf16) layer. On CPU
  the KV memory is VLLM_CPU_KVCACHE_SPACE GiB exactly, so weights are out of the picture."""
  monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
  monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
  from vllm.config.vllm import set_current_vllm_config
  from vllm.engine.arg_utils import EngineArgs
  from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
  from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
  from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
  from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
  from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

  cfg = SMALL.replace(num_layers=4, num_heads=4, num_kv_heads=2, hidden_size=128, max_position_embeddings=256)
  folder = tmp_path / "model"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "torch_dtype": "bfloat16"}))
  blocks = {}
  for kv, skip in (("bf16", ()), ("fp8", ()), ("fp8", (0,))):
    extra = {} if kv == "bf16" else {"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": [str(i) for i in skip]}
    vc = EngineArgs(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
                    **extra).create_engine_config()
    cc, mc = vc.cache_config, vc.model_config
    specs = {}
    for i in range(cfg.num_layers):  # as vllm's Attention.get_kv_cache_spec: skipped layers use "auto"
      dtype = "auto" if str(i) in cc.kv_cache_dtype_skip_layers else cc.cache_dtype
      specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
          block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
          head_size=mc.get_head_size(), dtype=kv_cache_dtype_str_to_dtype(dtype, mc),
          kv_quant_mode=get_kv_quant_mode(dtype))
    assert cc.kv_cache_memory_bytes == GIB  # what the CPU worker hands get_kv_cache_configs
    with set_current_vllm_config(vc):
      layouts = [layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]
      resolve_kv_cache_layout(vc, [layouts], list(specs.values()))
      (kv_config,) = get_kv_cache_configs(vc, [specs], [cc.kv_cache_memory_bytes])
    ours = kv_bytes_per_token(cfg, kv, skip)
    assert ours * cc.block_size == sum(s.page_size_bytes for s in specs.values())
    assert kv_config.num_blocks == kv_blocks(cc.kv_cache_memory_bytes, ours, cc.block_size)
    blocks[kv, skip] = kv_config.num_blocks
  assert blocks["bf16", ()] == GIB // (cfg.num_layers * 2 * 2 * 32 * 2 * 128)  # the two sides really differ
  assert blocks["fp8", ()] == 2 * blocks["bf16", ()]
  assert math.isclose(blocks["fp8", (0,)] / blocks["bf16", ()], 2 * 4 / 5, rel_tol=1e-3)
