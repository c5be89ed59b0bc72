"""`opdjax kv-capacity`: how many KV-cache tokens fit next to the weights in a memory budget.

An engine's memory is weights + an activation reserve + the KV cache. With L layers, K KV heads
of size E and b_l bytes per KV element in layer l (2 for bf16, 1 for fp8):

- `kv_bytes_per_token` = sum_l 2 * K * E * b_l (keys and values);
- `kv_blocks` = floor((memory - reserve - weights) / (block_size * kv_bytes_per_token)), the
  number of blocks vLLM allocates (`get_kv_cache_config_from_groups`: available // bytes per block,
  a block holding `block_size` tokens of every layer);
- `kv_tokens` = kv_blocks * block_size.

Weights are counted tensor by tensor from the shapes in the config, each at the format of the first
recipe row whose pattern matches its module path (`opdjax.perturb` paths and recipe syntax): bf16 is
2 bytes a parameter; fp8/int8 1 byte plus fp32 scales (`tensor`: one, `channel`: one per output
column, `block`: one per 128x128 tile). Norms, biases, `fp32` rows and unmatched tensors count as
bf16, because engines serve in bf16. The formulas and a cross-check against vLLM's own block
accounting are in docs/kv_capacity.md.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterable, Sequence

from opdjax.errors import UserError
from opdjax.models import quant
from opdjax.models.config import ModelConfig
from opdjax.views import perturb

GIB = 1 << 30
SCALE_BYTES = 4  # fp32 scales, as vLLM's fp8 linear layers and `quant.quantize` keep them
FORMAT_BYTES = {"fp32": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}  # fp32 serves as bf16
KV_BYTES = {"bf16": 2, "fp8": 1}
DEFAULT_RESERVE_FRACTION = 0.05
DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPU

# Published architectures (the models' Hugging Face config.json files), for planning without
# weights. Only what sizes memory is kept: RoPE variants change no tensor shape.
KNOWN_SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False),
}


# --- inputs ------------------------------------------------------------------------------------

def _config_from_dict(d: dict) -> ModelConfig:
  # RoPE scaling (e.g. Llama 3.1's) changes no tensor shape, so it is dropped rather than refused.
  d = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_parameters")}
  return ModelConfig.from_hf_dict(d)


def load_model_config(spec: str) -> tuple[str, ModelConfig]:
  """(display name, config) for a known name, `fetch:NAME`, an HF folder or a config.json path."""
  if spec.lower() in KNOWN_SHAPES:
    return spec.lower(), _config_from_dict(KNOWN_SHAPES[spec.lower()])
  if spec.startswith("fetch:"):
    from opdjax.models.fetch import resolve

    path = resolve(spec)
  else:
    path = spec
  cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(cfg_path):
    raise UserError(f"--model {spec!r}: no such folder or config.json; pass an HF folder with config.json, a"
                    f" config.json path, fetch:smollm2-135m, or a known shape: {', '.join(KNOWN_SHAPES)}.")
  try:
    with open(cfg_path) as f:
      d = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"could not read {cfg_path} as JSON ({e}).") from None
  if not isinstance(d, dict):
    raise UserError(f"{cfg_path} is not a Hugging Face config (a JSON object with model_type, hidden_size, ...).")
  try:
    return spec, _config_from_dict(d)
  except (KeyError, TypeError, ValueError) as e:
    if isinstance(e, UserError):
      raise
    raise UserError(f"{cfg_path} is not a usable Hugging Face config ({type(e).__name__}: {e}); it needs model_type,"
                    " vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads.") from None


def load_recipe(spec: str, num_layers: int, keep_edge_layers: int = 0) -> list[tuple[str, str]] | None:
  """A weight recipe from `bf16`/`fp32` (None: everything bf16), a preset name, a spec
  `pattern>format|pattern>format`, or a file holding a spec (one row a line, or the sensitivity
  tool's `recipe_view.txt`) or its `recipe.json` (`{"recipe": [[pattern, format], ...], ...}`)."""
  spec = spec.strip()
  if spec in ("bf16", "fp32"):
    return None
  if os.path.isfile(spec):
    with open(spec) as f:
      text = f.read()
    try:
      data = json.loads(text)
    except json.JSONDecodeError:
      spec = "|".join(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))
    else:
      rows = data.get("recipe") if isinstance(data, dict) else data
      if not isinstance(rows, list) or not all(isinstance(r, list | tuple) and len(r) == 2 for r in rows):
        raise UserError(f"{spec}: expected a JSON recipe {{\"recipe\": [[pattern, format], ...]}}.")
      return [(str(p), str(f)) for p, f in rows]
  spec = spec.removeprefix("weights=")  # the sensitivity tool's recipe_view.txt is an engine-view item
  if ">" in spec:
    return perturb.parse_recipe("|".join(row for row in spec.split("|") if row.strip()))
  try:
    return perturb.preset(spec, num_layers, keep_edge_layers)
  except UserError as e:
    raise UserError(f"--recipe {spec!r}: not a file or a 'pattern>format|...' spec, and {e}") from None


# --- weights -----------------------------------------------------------------------------------

def tensor_shapes(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
  """(module path, leaf name, shape) of every parameter, in `perturb.named_leaves` naming."""
  d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  q, kv = cfg.num_heads * e, cfg.num_kv_heads * e
  out = [("embed_tokens", "embedding", (cfg.vocab_size, d))]
  for i in range(cfg.num_layers):
    p = f"layers.{i}"
    out += [(f"{p}.input_layernorm", "weight", (d,)), (f"{p}.post_attention_layernorm", "weight", (d,))]
    for name, (n_in, n_out), bias in (("q_proj", (d, q), cfg.attention_bias), ("k_proj", (d, kv), cfg.attention_bias),
                                      ("v_proj", (d, kv), cfg.attention_bias), ("o_proj", (q, d), cfg.o_proj_bias)):
      out.append((f"{p}.self_attn.{name}", "kernel", (n_in, n_out)))
      if bias:
        out.append((f"{p}.self_attn.{name}", "bias", (n_out,)))
    if cfg.qk_norm:
      out += [(f"{p}.self_attn.q_norm", "weight", (e,)), (f"{p}.self_attn.k_norm", "weight", (e,))]
    for name, (n_in, n_out) in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d))):
      out.append((f"{p}.mlp.{name}", "kernel", (n_in, n_out)))
      if cfg.mlp_bias:
        out.append((f"{p}.mlp.{name}", "bias", (n_out,)))
  out.append(("norm", "weight", (d,)))
  if not cfg.tie_word_embeddings:
    out.append(("lm_head", "kernel", (d, cfg.vocab_size)))
  return out


def param_count(cfg: ModelConfig) -> int:
  return sum(math.prod(s) for _, _, s in tensor_shapes(cfg))


def _num_scales(shape: tuple[int, ...], granularity: str) -> int:
  """Scales `quant.quantize` keeps for a matrix: one, one per output column, or one per 128x128 tile."""
  if granularity == "tensor":
    return 1
  if granularity == "channel":
    return shape[-1]
  return math.ceil(shape[-2] / quant.BLOCK) * math.ceil(shape[-1] / quant.BLOCK)


def weight_footprint(cfg: ModelConfig, recipe: Sequence[tuple[str, str]] | None = None) -> dict[str, int]:
  """{"params", "quantized_params", "scale_bytes", "bytes"} of the weights served under `recipe`
  (None: all bf16). Every pattern must match some module, as in `perturb.apply_recipe`."""
  shapes = tensor_shapes(cfg)
  rows = [(pat, quant.QuantFormat.parse(fmt)) for pat, fmt in (recipe or [])]
  modules = sorted({m for m, _, _ in shapes})
  for pat, _ in rows:
    # Presets always name lm_head; with tied embeddings it is embed_tokens, already counted.
    if pat == "lm_head" and cfg.tie_word_embeddings:
      continue
    if not any(fnmatch.fnmatchcase(m, pat) for m in modules):
      raise UserError(f"recipe pattern {pat!r} matches nothing; paths look like {', '.join(modules[:3])}, ...,"
                      f" {modules[-1]} (shell patterns: '*.self_attn.*', 'layers.3.mlp.*').")
  params = quantized = scale_bytes = total = 0
  for mod, _, shape in shapes:
    n = math.prod(shape)
    fmt = next((f for pat, f in rows if fnmatch.fnmatchcase(mod, pat)), None)
    params += n
    if fmt is None or len(shape) < 2 or fmt.name in ("fp32", "bf16"):
      total += n * FORMAT_BYTES["bf16"]
      continue
    scales = _num_scales(shape, fmt.granularity) * SCALE_BYTES
    quantized += n
    scale_bytes += scales
    total += n * FORMAT_BYTES[fmt.name] + scales
  return {"params": params, "quantized_params": quantized, "scale_bytes": scale_bytes, "bytes": total}


# --- KV cache ----------------------------------------------------------------------------------

def check_layers(cfg: ModelConfig, layers: Iterable[int]) -> tuple[int, ...]:
  layers = tuple(sorted(set(layers)))
  bad = [i for i in layers if not 0 <= i < cfg.num_layers]
  if bad:
    raise UserError(f"KV bf16 layer(s) {bad} out of range: the model has {cfg.num_layers} layers,"
                    f" 0..{cfg.num_layers - 1}.")
  return layers


def kv_bytes_per_token(cfg: ModelConfig, kv: str = "bf16", bf16_layers: Iterable[int] = ()) -> int:
  """Bytes of keys and values one token takes over all layers; with `kv="fp8"`, the layers in
  `bf16_layers` stay bf16 (vLLM's `--kv-cache-dtype-skip-layers`)."""
  if kv not in KV_BYTES:
    raise UserError(f"KV cache dtype {kv!r}; choose {' or '.join(KV_BYTES)}.")
  keep = check_layers(cfg, bf16_layers)
  per_elem = [KV_BYTES["bf16"] if kv == "bf16" or i in keep else KV_BYTES[kv] for i in range(cfg.num_layers)]
  return sum(2 * cfg.num_kv_heads * cfg.head_dim * b for b in per_elem)


def kv_blocks(available_bytes: int, bytes_per_token: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
  """Whole blocks of `block_size` tokens (of every layer) that fit, as vLLM counts them."""
  return max(available_bytes, 0) // (block_size * bytes_per_token)


def default_reserve_gib(memory_gib: float) -> float:
  return DEFAULT_RESERVE_FRACTION * memory_gib


def plan(cfg: ModelConfig, recipe: Sequence[tuple[str, str]] | None, kv: str, bf16_layers: Iterable[int],
         memory_gib: float, reserve_gib: float | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
  """One configuration: weights, KV bytes a token, blocks and tokens that fit (0 if the weights don't)."""
  if memory_gib <= 0 or block_size < 1:
    raise UserError(f"memory_gib={memory_gib} and block_size={block_size} must be positive.")
  reserve_gib = default_reserve_gib(memory_gib) if reserve_gib is None else reserve_gib
  if reserve_gib < 0:
    raise UserError(f"reserve_gib={reserve_gib} must be >= 0.")
  w = weight_footprint(cfg, recipe)
  per_token = kv_bytes_per_token(cfg, kv, bf16_layers)
  available = int(memory_gib * GIB) - int(reserve_gib * GIB) - w["bytes"]
  blocks = kv_blocks(available, per_token, block_size)
  return {"weight_gib": w["bytes"] / GIB, "weight_bytes": w["bytes"], "scale_bytes": w["scale_bytes"],
          "kv_bytes_per_token": per_token, "kv_available_gib": max(available, 0) / GIB, "kv_blocks": blocks,
          "kv_tokens": blocks * block_size, "fits": blocks > 0,
          "memory_needed_gib": (w["bytes"] + block_size * per_token) / GIB + reserve_gib}


def _ratio(tokens: int, base: int) -> float | None:
  return tokens / base if base else None


def capacity_for_view(model_cfg, view, memory_gib: float, reserve_gib: float | None = None) -> dict:
  """KV capacity of an `opdjax.views.view.EngineView`'s weights and KV dtype in `memory_gib`; the
  ratio is against bf16 weights and bf16 KV in the same memory (None when those do not fit).
  fp32 weights and `kv_quant="none"` count as the bf16 serving baseline."""
  recipe = view.recipe(model_cfg.num_layers)
  kv = "bf16" if view.kv_quant == "none" else "fp8"
  out = plan(model_cfg, recipe, kv, (), memory_gib, reserve_gib)
  if not out["fits"]:
    raise UserError(f"{view} does not fit in {memory_gib:.2f} GiB: it needs at least"
                    f" {out['memory_needed_gib']:.2f} GiB (weights {out['weight_gib']:.2f} GiB + reserve + one block).")
  base = plan(model_cfg, None, "bf16", (), memory_gib, reserve_gib)
  return {**out, "kv_tokens_ratio": _ratio(out["kv_tokens"], base["kv_tokens"])}


# --- the report --------------------------------------------------------------------------------

def capacity_table(cfg: ModelConfig, recipe: Sequence[tuple[str, str]] | None, memory_gib: float,
                   reserve_gib: float | None = None, kv_bf16_layers: Iterable[int] = (),
                   block_size: int = DEFAULT_BLOCK_SIZE, recipe_name: str = "recipe") -> dict:
  """Rows for (bf16 weights | recipe) x (bf16 KV | fp8 KV with `kv_bf16_layers` in bf16)."""
  reserve_gib = default_reserve_gib(memory_gib) if reserve_gib is None else reserve_gib
  layers = check_layers(cfg, kv_bf16_layers)
  weights = [("bf16", None)] + ([(recipe_name, recipe)] if recipe else [])
  fp8_label = "fp8" + (f" (bf16 layers {','.join(map(str, layers))})" if layers else "")
  rows = []
  for w_name, w_recipe in weights:
    for kv, kv_label in (("bf16", "bf16"), ("fp8", fp8_label)):
      rows.append({"weights": w_name, "kv": kv_label,
                   **plan(cfg, w_recipe, kv, layers, memory_gib, reserve_gib, block_size)})
  if not any(r["fits"] for r in rows):
    need = min(r["memory_needed_gib"] for r in rows)
    raise UserError(f"nothing fits in {memory_gib:.2f} GiB with a {reserve_gib:.2f} GiB reserve: the smallest"
                    f" configuration needs {need:.2f} GiB (weights + reserve + one KV block of {block_size} tokens).")
  base = rows[0]["kv_tokens"]
  for r in rows:
    r["kv_tokens_ratio"] = _ratio(r["kv_tokens"], base)
  return {
      "params": param_count(cfg), "memory_gib": memory_gib, "reserve_gib": reserve_gib, "block_size": block_size,
      "kv_bf16_layers": list(layers), "recipe": [list(r) for r in recipe] if recipe else None,
      "kv_bytes_ratio": kv_bytes_per_token(cfg) / kv_bytes_per_token(cfg, "fp8", layers), "rows": rows,
  }


def report(result: dict) -> str:
  head = (f"{result['model']}: {result['params'] / 1e6:.1f}M params, {result['num_layers']} layers;"
          f" {result['memory_gib']:.2f} GiB, reserve {result['reserve_gib']:.2f} GiB, block {result['block_size']}"
          f" tokens. KV bytes bf16/fp8 = {result['kv_bytes_ratio']:.4f}")
  cols = ("weights", "kv", "weight GiB", "KV B/token", "KV blocks", "KV tokens", "ratio")
  lines = [[r["weights"], r["kv"], f"{r['weight_gib']:.3f}", str(r["kv_bytes_per_token"]), f"{r['kv_blocks']:,}",
            f"{r['kv_tokens']:,}" if r["fits"] else f"0 (needs {r['memory_needed_gib']:.2f} GiB)",
            "-" if r["kv_tokens_ratio"] is None else f"{r['kv_tokens_ratio']:.3f}x"] for r in result["rows"]]
  widths = [max(len(c), *(len(row[i]) for row in lines)) for i, c in enumerate(cols)]
  fmt = lambda row: "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
  return "\n".join([head, fmt(cols), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def parse_layers(text: str) -> list[int]:
  """`--kv-bf16-layers 0,27` -> [0, 27]."""
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise UserError(f"--kv-bf16-layers {text!r}: expected comma-separated layer indices, e.g. 0,27.") from None
