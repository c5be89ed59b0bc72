"""`rollout.vllm.recipe`: a sensitivity recipe as a vLLM server's flags, checked against vLLM itself.

The fast tests read and translate recipes and refuse bad ones. The vLLM tests (CPU, no server) parse the
very command `make_vllm_server` builds with vLLM's own server argument parser, build the engine config
from it (`AsyncEngineArgs.from_cli_args(...).create_engine_config()`, vLLM's own quantization config),
and construct vLLM's Qwen3 model on the meta device from that config: every linear layer vLLM
instantiates (the fused qkv_proj / gate_up_proj) gets an FP8 method unless the recipe keeps it in bf16,
and every attention layer an fp8 KV cache unless the recipe keeps its KV in bf16. No FP8 math runs.
"""

import dataclasses
import json
import math
import re

import pytest
from helpers import free_port

from opdjax.analyses import capacity, sensitivity
from opdjax.cli import main as cli_main
from opdjax.config.schema import VllmConfig
from opdjax.errors import UserError
from opdjax.models.config import ModelConfig
from opdjax.rollout.vllm import launch as factory
from opdjax.rollout.vllm import recipe
from opdjax.rollout.vllm.server import SERVER_MODULE
from opdjax.views import perturb

TINY = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=256)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def write_recipe(path, cfg, bf16_layers, fmt="fp8_e4m3:tensor", **extra):
  """recipe.json with the keys and rows `opdjax sensitivity` writes (its own row builders)."""
  rows = sensitivity.recipe_rows(bf16_layers, fmt, has_lm_head=not cfg.tie_word_embeddings)
  spec = sensitivity.recipe_spec(rows)
  model = {"model_type": cfg.model_type, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings, "role": "student",
           "path": "tiny"}
  data = {"engine_view": "weights=" + spec, "weights": spec, "bf16_layers": sorted(bf16_layers), "format": fmt,
          "k": len(bf16_layers), "recipe": [list(r) for r in rows], "model": model, **extra}
  path.write_text(json.dumps(data))
  return str(path)


def unfused(layers):
  return {f"model.layers.{i}.{p}" for i in layers for p in PROJ}


# --- reading and translating -------------------------------------------------------------------

@pytest.mark.parametrize("fmt,scheme", [("fp8_e4m3:tensor", "fp8_per_tensor"), ("fp8_e4m3:channel", "fp8_per_channel"),
                                        ("fp8_e4m3:block", "fp8_per_block")])
def test_sensitivity_recipe_and_its_view_translate_alike(tmp_path, fmt, scheme):
  path = write_recipe(tmp_path / "recipe.json", TINY, [3, 0], fmt)
  view = json.loads(open(path).read())["engine_view"]
  (tmp_path / "recipe_view.txt").write_text(view + "\n")
  loaded = [recipe.load(s) for s in (path, view, str(tmp_path / "recipe_view.txt"))]
  jax_rows = tuple(perturb.parse_recipe(view.removeprefix("weights=")))  # what the JAX engine applies
  assert all(r.rows == jax_rows for r in loaded)
  assert loaded[0].model["num_layers"] == 4 and loaded[1].model is None
  for r in loaded:
    v = recipe.translate(r, TINY)
    assert v.quantization == scheme and set(v.ignore) == unfused([0, 3]) and len(v.ignore) == 14
    assert v.kv_bf16_layers == (0, 3) and v.kv_cache_dtype == "fp8"
  assert recipe.linear_modules(TINY) == [f"model.layers.{i}.{p}" for i in range(4) for p in PROJ]


def test_kind_rows_explicit_kv_layers_and_the_all_bf16_recipe(tmp_path):
  kinds = recipe.load("weights=embed_tokens>bf16|*.mlp.down_proj>bf16|layers.2.*>bf16|*>fp8_e4m3:tensor")
  v = recipe.translate(kinds, TINY)
  assert set(v.ignore) == unfused([2]) | {f"model.layers.{i}.mlp.down_proj" for i in range(4)}
  assert v.kv_bf16_layers == (2,)  # only layer 2 is bf16 whole
  assert v.args()[-2:] == ["--kv-cache-dtype-skip-layers", "2"]
  explicit = recipe.load(write_recipe(tmp_path / "kv.json", TINY, [0], kv_bf16_layers=[3, 1]))
  assert recipe.translate(explicit, TINY).kv_bf16_layers == (1, 3)
  assert set(recipe.translate(explicit, TINY).ignore) == unfused([0])
  none_kv = recipe.load(write_recipe(tmp_path / "none.json", TINY, [0], kv_bf16_layers=[]))
  assert recipe.translate(none_kv, TINY).args()[-2:] == ["--kv-cache-dtype", "fp8"]  # no skip flag
  every = recipe.translate(recipe.load(write_recipe(tmp_path / "all.json", TINY, [0, 1, 2, 3])), TINY)
  assert (every.quantization, every.kv_cache_dtype, every.args()) == (None, None, [])  # nothing left to quantize


def test_the_server_command_carries_the_recipe(tmp_path):
  folder = tmp_path / "model"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
  path = write_recipe(tmp_path / "recipe.json", TINY, [1])
  vcfg = VllmConfig(dtype="bfloat16", recipe=path, extra_args="--max-num-seqs 8")
  vcfg.check()
  cmd = factory.make_vllm_server(vcfg, str(folder), max_len=64, batch_size=4, out_dir=str(tmp_path)).command()
  flags = recipe.translate(recipe.load(path), TINY).args()
  i = cmd.index("--quantization")
  assert cmd[i:i + len(flags)] == flags and cmd[-2:] == ["--max-num-seqs", "8"]  # the user's flags come last
  plain = factory.make_vllm_server(VllmConfig(), str(folder), max_len=64, batch_size=4, out_dir=str(tmp_path))
  assert "--quantization" not in plain.command() and "--kv-cache-dtype" not in plain.command()


# --- bad input: one clear error each -----------------------------------------------------------

def _bad_recipes(tmp_path):
  other = TINY.replace(num_layers=6)
  (tmp_path / "broken.json").write_text('{"recipe": [["layers.0.*", "bf16"],')
  (tmp_path / "list.json").write_text('{"rows": []}')
  return {
      "missing": (str(tmp_path / "nope.json"), "no such file"),
      "malformed": (str(tmp_path / "broken.json"), "is not valid JSON"),
      "not a recipe": (str(tmp_path / "list.json"), "is not a recipe"),
      "other model (shape)": (write_recipe(tmp_path / "six.json", other, [5]), "num_layers 6 (served: 4)"),
      "other model (names)": ("weights=layers.5.*>bf16|*>fp8_e4m3:tensor", "'layers.5.*' matches no module"),
      "kv layer out of range": (write_recipe(tmp_path / "kv.json", TINY, [0], kv_bf16_layers=[7]), "has 4 layers"),
      "e5m2": (write_recipe(tmp_path / "e5.json", TINY, [0], "fp8_e5m2:channel"), "recipe_format=fp8_e4m3"),
      "int8": ("weights=layers.0.*>bf16|*>int8", "recipe_format=fp8_e4m3"),
      "mixed": ("weights=*.mlp.*>fp8_e4m3:block|*>fp8_e4m3:tensor", "mixes fp8_e4m3:block, fp8_e4m3:tensor"),
      "fused shards": ("weights=embed_tokens>bf16|*.q_proj>bf16|*>fp8_e4m3:tensor", "one matrix (qkv_proj)"),
      "embedding": ("weights=*>fp8_e4m3:tensor", "quantizes embed_tokens"),
      "not only weights": ("weights=layers.0.*>bf16|*>fp8_e4m3:tensor,lag=2", "'lag=2' is not part of it"),
      "preset": ("weights=fp8", "is a preset"),
  }


@pytest.mark.parametrize("case", ["missing", "malformed", "not a recipe", "other model (shape)", "other model (names)",
                                  "kv layer out of range", "e5m2", "int8", "mixed", "fused shards", "embedding",
                                  "not only weights", "preset"])
def test_bad_recipe_is_one_error(tmp_path, case):
  spec, message = _bad_recipes(tmp_path)[case]
  with pytest.raises(UserError, match=re.escape(message)) as e:
    recipe.translate(recipe.load(spec), TINY)
  assert "\n" not in str(e.value) and "rollout.vllm.recipe" in str(e.value)


@pytest.mark.parametrize("changes,message", [
    ({"dtype": "float32"}, "set rollout.vllm.dtype=bfloat16"),
    ({"quantization": "fp8"}, "leave rollout.vllm.quantization empty"),
    ({"kv_cache_dtype": "fp8"}, "leave rollout.vllm.kv_cache_dtype empty"),
    ({"extra_args": "--kv-cache-dtype=fp8 --max-num-seqs 8"}, "sets --kv-cache-dtype; remove them"),
    ({"recipe": "weights=layers.0.*>bf16|*>fp8_e5m2:tensor"}, "sensitivity.recipe_format"),
    ({"recipe": "runs/none/recipe.json"}, "no such file"),
])
def test_config_refuses_a_recipe_it_cannot_serve(changes, message):
  ok = VllmConfig(dtype="bfloat16", recipe="weights=layers.0.*>bf16|*>fp8_e4m3:tensor")
  ok.check()  # the file-free checks pass with bf16 and nothing else set
  with pytest.raises(UserError, match=message):
    dataclasses.replace(ok, **changes).check()


# --- opdjax kv-capacity --recipe ---------------------------------------------------------------

def test_kv_capacity_of_the_recipe_file(tmp_path, capsys):
  _, cfg = capacity.load_model_config("qwen3-1.7b")
  path = write_recipe(tmp_path / "recipe.json", cfg, [27], "fp8_e4m3:channel")
  out = tmp_path / "r.json"
  assert cli_main(["kv-capacity", "--model", "qwen3-1.7b", "--memory-gib", "72", "--recipe", path,
                   "--json", str(out)]) == 0
  assert "fp8 (bf16 layers 27)" in capsys.readouterr().out
  result = json.loads(out.read_text())
  served = recipe.translate(recipe.load(path), cfg)
  assert result["kv_bf16_layers"] == list(served.kv_bf16_layers) == [27]  # the layers the server skips
  rows = {(r["weights"], r["kv"]): r for r in result["rows"]}
  kv8 = rows[("bf16", "fp8 (bf16 layers 27)")]
  assert kv8["kv_bytes_per_token"] == capacity.kv_bytes_per_token(cfg, "fp8", [27]) == 2 * 8 * 128 * (27 + 2)
  assert math.isclose(kv8["kv_tokens_ratio"], 2 * 28 / 29, rel_tol=2e-3)  # one bf16 KV layer of 28: 1.93x
  both = rows[("recipe.json", "fp8 (bf16 layers 27)")]
  assert both["weight_bytes"] == capacity.weight_footprint(cfg, list(recipe.load(path).rows))["bytes"]
  assert both["kv_tokens_ratio"] > kv8["kv_tokens_ratio"]
  # --kv-bf16-layers still overrides the file's layers; a recipe for another model is refused.
  assert cli_main(["kv-capacity", "--model", "qwen3-1.7b", "--memory-gib", "72", "--recipe", path,
                   "--kv-bf16-layers", "0,27", "--json", str(out)]) == 0
  assert json.loads(out.read_text())["kv_bf16_layers"] == [0, 27]
  capsys.readouterr()
  assert cli_main(["kv-capacity", "--model", "qwen3-4b", "--memory-gib", "72", "--recipe", path]) == 2
  assert "num_layers 28 (served: 36)" in capsys.readouterr().err


# --- against vLLM itself -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """`served(recipe_path, build=True) -> (engine args, vllm config, {linear: method}, {attn: kv dtype})`
  from the command `make_vllm_server` builds, parsed as `python -m vllm.entrypoints.openai.api_server`
  parses it; the model is constructed on the meta device when `build`."""
  tmp = tmp_path_factory.mktemp("vllm-recipe")
  folder = tmp / "model"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
    import torch
    from vllm.config.vllm import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import (
      destroy_distributed_environment,
      destroy_model_parallel,
      model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    started = []

    def serve(path, build=True):
      vcfg = VllmConfig(dtype="bfloat16", recipe=path)
      cmd = factory.make_vllm_server(vcfg, str(folder), max_len=128, batch_size=4, out_dir=str(tmp)).command()
      assert cmd[1:3] == ["-m", SERVER_MODULE]
      args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
      validate_parsed_serve_args(args)
      engine_args = AsyncEngineArgs.from_cli_args(args)
      vc = engine_args.create_engine_config()
      if not build:
        return engine_args, vc, None, None
      with set_current_vllm_config(vc):
        # A vllm.LLM run earlier in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, tests/test_vllm.py or
        # test_fetch.py in the same pytest-xdist worker) leaves its one-rank groups set up: reuse them.
        if not started and not model_parallel_is_initialized():
          init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                       distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
          initialize_model_parallel(1, 1)
          started.append(True)
        with torch.device("meta"):
          model = initialize_model(vllm_config=vc)
      linears = {n: type(m.quant_method).__name__ for n, m in model.named_modules() if isinstance(m, LinearBase)}
      attn = {n: m.kv_cache_dtype for n, m in model.named_modules() if n.endswith(".attn")}
      return engine_args, vc, linears, attn

    yield serve, tmp
    if started:
      destroy_model_parallel()
      destroy_distributed_environment()


def fused(layers):
  return {f"model.layers.{i}.{p}" for i in layers for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                           "mlp.gate_up_proj", "mlp.down_proj")}


@pytest.mark.slow
@pytest.mark.requires_vllm
@pytest.mark.parametrize("fmt,method", [("fp8_e4m3:tensor", "Fp8PerTensorOnlineLinearMethod"),
                                        ("fp8_e4m3:channel", "Fp8PtpcOnlineLinearMethod")])
def test_vllm_builds_exactly_the_recipe(served, fmt, method):
  serve, tmp = served
  path = write_recipe(tmp / f"recipe-{fmt[-5:]}.json", TINY, [0, 2], fmt)
  engine_args, vc, linears, attn = serve(path)
  # (a) vLLM's parser and engine args read the flags (not a string comparison)
  assert engine_args.quantization == recipe.ONLINE_SCHEMES[fmt] and engine_args.dtype == "bfloat16"
  assert set(engine_args.quantization_config.ignore) == unfused([0, 2])
  assert engine_args.quantization_config.linear is not None  # the shorthand's scheme survived the merge
  assert (vc.cache_config.cache_dtype, vc.cache_config.kv_cache_dtype_skip_layers) == ("fp8", ["0", "2"])
  # (b) vLLM's model: fused matrices, bf16 exactly where the recipe keeps whole layers
  assert set(linears) == fused(range(4))
  assert {n for n, m in linears.items() if m == "UnquantizedLinearMethod"} == fused([0, 2])
  assert {n for n, m in linears.items() if m == method} == fused([1, 3])
  # (c) the KV cache: bf16 ("auto") in the recipe's KV layers, fp8 in the others
  assert attn == {f"model.layers.{i}.self_attn.attn": "auto" if i in (0, 2) else "fp8" for i in range(4)}


@pytest.mark.slow
@pytest.mark.requires_vllm
def test_vllm_skip_matching_per_block_and_per_kind(served):
  """vLLM's own decision (`resolve_quant_method_cls` -> `should_ignore_layer` with the model class's fused
  mapping, as `configure_quant_config` passes it) for recipes this CPU cannot build kernels for (blocks)."""
  serve, tmp = served
  from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
  from vllm.model_executor.model_loader.utils import configure_quant_config, get_model_architecture

  cases = {
      "block": ("weights=embed_tokens>bf16|layers.3.*>bf16|*>fp8_e4m3:block", fused([3]), (3,)),
      "kinds": ("weights=embed_tokens>bf16|*.mlp.down_proj>bf16|layers.1.*>bf16|*>fp8_e4m3:tensor",
                fused([1]) | {f"model.layers.{i}.mlp.down_proj" for i in range(4)}, (1,)),
  }
  kinds = {"qkv_proj": QKVParallelLinear, "o_proj": RowParallelLinear, "gate_up_proj": MergedColumnParallelLinear,
           "down_proj": RowParallelLinear}
  for spec, bf16, kv in cases.values():
    (tmp / "view.txt").write_text(spec)
    engine_args, vc, _, _ = serve(str(tmp / "view.txt"), build=False)
    assert vc.cache_config.kv_cache_dtype_skip_layers == [str(i) for i in kv]
    model_cls, _ = get_model_architecture(vc.model_config)
    configure_quant_config(vc.quant_config, model_cls)
    assert {k: tuple(v) for k, v in model_cls.packed_modules_mapping.items()} == recipe.FUSED
    skipped = {n for n in fused(range(4))
               if vc.quant_config.resolve_quant_method_cls(kinds[n.rsplit(".", 1)[1]], n) is None}
    assert skipped == bf16


@pytest.mark.slow
@pytest.mark.requires_vllm
def test_vllm_refuses_what_the_recipe_check_refuses_first(served):
  """The dtype rule is vLLM's: online FP8 on a float32 model is its error at engine-config time."""
  serve, tmp = served
  from vllm.engine.arg_utils import EngineArgs
  from vllm.model_executor.models.llama import LlamaForCausalLM
  from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

  with pytest.raises(Exception, match="float32 is not supported for quantization method fp8_per_tensor"):
    EngineArgs(model=str(tmp / "model"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
               quantization="fp8_per_tensor").create_engine_config()
  for cls in (LlamaForCausalLM, Qwen2ForCausalLM):  # the other families opdjax serves fuse the same way
    assert {k: tuple(v) for k, v in cls.packed_modules_mapping.items()} == recipe.FUSED
