"""A model-specific FP8 recipe (`opdjax sensitivity`'s recipe.json, or its one-line view) as the
configuration of a vLLM server: `rollout.vllm.recipe`.

vLLM 0.32 quantizes a bf16 checkpoint while loading it ("online"): `--quantization fp8_per_tensor`,
`fp8_per_channel` or `fp8_per_block` (`vllm/config/quantization.py`, `_ONLINE_SHORTHANDS`; plain
`fp8` is deprecated there and means `fp8_per_tensor`), with the layers to keep unquantized in
`--quantization-config '{"ignore": [...]}'`. `OnlineQuantizationConfig.resolve_quant_method_cls`
(`model_executor/layers/quantization/online/base.py`) skips a linear layer when
`should_ignore_layer` (`compressed_tensors/utils.py`, via `find_matching_patterns` with the model's
`packed_modules_mapping`) finds every shard of it in the ignore list, so the list holds the HF
(unfused) module names, `model.layers.3.self_attn.q_proj`, and vLLM's fused `qkv_proj` /
`gate_up_proj` are skipped when all their shards are listed (some but not all is vLLM's error, and
ours first). The KV cache is `--kv-cache-dtype fp8` with the bf16 layers' indices in
`--kv-cache-dtype-skip-layers` (`Attention.__init__` keeps `auto`, the model dtype, for a layer whose
`extract_layer_index(prefix)` is listed).

What the recipe keeps in bf16: a weight matrix whose first matching row is bf16 or fp32 (or none);
the KV cache of the layers in the recipe's `kv_bf16_layers` when it has that key, else of the layers
whose every matrix stays bf16 (the sensitivity recipe's `bf16_layers`). The KV-token ratio of the
same file is `opdjax kv-capacity --recipe FILE`, through `kv_bf16_layers` here.

Only what vLLM's online scheme produces is accepted: FP8 e4m3 with per-tensor, per-channel or
128x128-block scales, one scheme for every quantized matrix, embeddings and lm_head in bf16 (vLLM
never quantizes them online), and the q/k/v (gate/up) matrices of a layer alike. The numerics are
not the JAX engine's bit for bit: vLLM also quantizes activations (dynamic per token or per tensor,
per 128-group for blocks), and its per-tensor scale spans a fused qkv / gate_up matrix.

This module has no vLLM import: it runs where the trainer runs; tests check it against vLLM's own
argument parser, quantization config and model construction (tests/test_vllm_recipe.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shlex

from opdjax.errors import UserError
from opdjax.models.config import ModelConfig
from opdjax.models.hf_io import PARAM_TABLE, hf_names
from opdjax.models.quant import QuantFormat

# Recipe format -> vLLM 0.32's online shorthand (`--quantization`).
ONLINE_SCHEMES = {"fp8_e4m3:tensor": "fp8_per_tensor", "fp8_e4m3:channel": "fp8_per_channel",
                  "fp8_e4m3:block": "fp8_per_block"}
# vLLM's `packed_modules_mapping` of LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (tested).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# `vllm serve` flags the recipe sets; given elsewhere too, one would silently win over the other.
RECIPE_FLAGS = ("--quantization", "-q", "--quantization-config", "--kv-cache-dtype", "--kv-cache-dtype-skip-layers",
                "--dtype")
FIX_FORMAT = ("rebuild the recipe in a format vLLM produces: `opdjax sensitivity"
              " --config.sensitivity.recipe_format=fp8_e4m3:channel` (or fp8_e4m3:tensor, fp8_e4m3:block)")
FIX_MODEL = ("build the recipe for the model this server serves: `opdjax sensitivity --config.sensitivity.model=student"
             " --out DIR` (the default analyses the teacher)")
_UNQUANTIZED = ("bf16", "fp32")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Weight rows `(pattern, format)`, first match wins, as `perturb.parse_recipe` gives them; `kv_layers`:
  the recipe's explicit `kv_bf16_layers` (None: the layers kept whole in bf16); `model`: recipe.json's
  description of the model it was built for (None for a view)."""

  rows: tuple[tuple[str, str], ...]
  source: str
  kv_layers: tuple[int, ...] | None = None
  model: dict | None = None


@dataclasses.dataclass(frozen=True)
class VllmRecipe:
  """A recipe in vLLM's terms: the online scheme (None: no matrix quantized), the unfused module names it
  keeps in bf16, and the layers whose KV cache stays bf16 under `--kv-cache-dtype fp8` (all: bf16 KV)."""

  quantization: str | None
  ignore: tuple[str, ...]
  kv_bf16_layers: tuple[int, ...]
  num_layers: int

  @property
  def kv_cache_dtype(self) -> str | None:
    return "fp8" if len(self.kv_bf16_layers) < self.num_layers else None

  def args(self) -> list[str]:
    """The `vllm serve` flags (vLLM's spelling; `nargs='+'` for the skip list)."""
    out = []
    if self.quantization:
      out += ["--quantization", self.quantization]
      if self.ignore:
        out += ["--quantization-config", json.dumps({"ignore": list(self.ignore)}, separators=(",", ":"))]
    if self.kv_cache_dtype:
      out += ["--kv-cache-dtype", self.kv_cache_dtype]
      if self.kv_bf16_layers:
        out += ["--kv-cache-dtype-skip-layers", *map(str, self.kv_bf16_layers)]
    return out


# --- reading -----------------------------------------------------------------------------------

def _parse_rows(spec: str, where: str) -> tuple[tuple[str, str], ...]:
  """`pattern>format|...` (the syntax of `perturb.parse_recipe`, which sits a layer above rollout)."""
  rows = []
  for row in spec.split("|"):
    pat, sep, fmt = row.partition(">")
    if not sep or not pat.strip() or not fmt.strip():
      raise UserError(f"{where}: recipe row {row!r} is not 'pattern>format' (e.g."
                      " 'layers.0.*>bf16|*>fp8_e4m3:tensor').")
    try:
      QuantFormat.parse(fmt.strip())
    except UserError as e:
      raise UserError(f"{where}: {e}") from None
    rows.append((pat.strip(), fmt.strip()))
  return tuple(rows)


def _from_view(text: str, where: str) -> tuple[tuple[str, str], ...]:
  """Rows of a one-line view (`weights=pattern>format|...`, recipe_view.txt) or a bare row spec."""
  items = [i.strip() for i in text.split(",") if i.strip()]
  extra = [i for i in items if not i.startswith("weights=")]
  if len(items) != 1 or extra:
    raise UserError(f"{where}: a recipe is one weights item, 'weights=pattern>format|...' (recipe_view.txt);"
                    f" {', '.join(extra) or text!r} is not part of it (lag and noise belong in rollout.view).")
  spec = items[0].removeprefix("weights=")
  if ">" not in spec:
    raise UserError(f"{where}: {spec!r} is a preset, not a recipe; give the rows 'pattern>format|...' that"
                    " `opdjax sensitivity` writes (or rollout.vllm.quantization for one global FP8).")
  return _parse_rows(spec, where)


def _from_json(data, path: str, where: str) -> Recipe:
  rows = data.get("recipe") if isinstance(data, dict) else data
  if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and len(r) == 2 for r in rows):
    raise UserError(f"{where}: {path} is not a recipe: expected the JSON `opdjax sensitivity` writes,"
                    ' {"recipe": [[pattern, format], ...], ...}.')
  kv = data.get("kv_bf16_layers") if isinstance(data, dict) else None
  if kv is not None and not (isinstance(kv, list) and all(isinstance(i, int) for i in kv)):
    raise UserError(f"{where}: {path}: kv_bf16_layers must be a list of layer indices (got {kv!r}).")
  model = data.get("model") if isinstance(data, dict) and isinstance(data.get("model"), dict) else None
  rows = _parse_rows("|".join(f"{p}>{f}" for p, f in rows), f"{where} ({path})")
  return Recipe(rows, path, None if kv is None else tuple(sorted(set(kv))), model)


def load(spec: str, where: str = "rollout.vllm.recipe") -> Recipe:
  """A recipe from a file (recipe.json, or a text file holding the view: recipe_view.txt) or the view itself.
  Formats are read, not judged here: `kv-capacity` plans INT8 too; `translate` refuses what vLLM cannot do."""
  spec = spec.strip()
  if not os.path.isfile(spec):
    if ">" in spec or spec.startswith("weights="):
      return Recipe(_from_view(spec, where), "the recipe")
    raise UserError(f"{where}={spec!r}: no such file. Give the recipe.json that `opdjax sensitivity --out DIR`"
                    " writes (DIR/recipe.json), or its one-line view (the line in DIR/recipe_view.txt).")
  try:
    with open(spec) as f:
      text = f.read()
  except OSError as e:
    raise UserError(f"{where}={spec!r}: cannot read it ({e}).") from None
  if spec.endswith(".json") or text.lstrip().startswith(("{", "[")):
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise UserError(f"{where}={spec!r} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); write it"
                      " again with `opdjax sensitivity --out DIR`.") from None
    return _from_json(data, spec, where)
  lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
  if not lines:
    raise UserError(f"{where}={spec!r} is empty; give recipe.json or recipe_view.txt from `opdjax sensitivity`.")
  return Recipe(_from_view("|".join(lines), f"{where} ({spec})"), spec)


# --- the model's modules -----------------------------------------------------------------------

def linear_modules(cfg: ModelConfig) -> list[str]:
  """HF (unfused) names of the decoder layers' matrices, the names vLLM's ignore list takes."""
  present = set(hf_names(cfg))
  return [hf.format(i=i).removesuffix(".weight") for i in range(cfg.num_layers) for _, hf, t in PARAM_TABLE
          if t and "{i}" in hf and hf.format(i=i) in present]


def _modules(cfg: ModelConfig) -> list[str]:
  """Every module path of the params (opdjax naming: the HF name without `model.`)."""
  return sorted({n.rsplit(".", 1)[0].removeprefix("model.") for n in hf_names(cfg)})


def _check_model(recipe: Recipe, cfg: ModelConfig, where: str) -> None:
  """The recipe names this model: its recorded shape matches, and every row's pattern selects a module."""
  m = recipe.model or {}
  ours = {"model_type": cfg.model_type, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
          "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings}
  diff = [f"{k} {m[k]} (served: {v})" for k, v in ours.items() if k in m and m[k] != v]
  if diff:
    made = m.get("path") or m.get("role") or "another model"
    raise UserError(f"{where}: {recipe.source} was built for {made}: {', '.join(diff)}; {FIX_MODEL}.")
  modules = _modules(cfg)
  for pat, _ in recipe.rows:
    if pat == "lm_head" and cfg.tie_word_embeddings:
      continue  # tied: the head is embed_tokens (sensitivity always writes this row)
    if not any(fnmatch.fnmatchcase(p, pat) for p in modules):
      raise UserError(f"{where}: {recipe.source} row {pat!r} matches no module of the served model"
                      f" ({cfg.model_type}, {cfg.num_layers} layers, modules layers.0.self_attn.q_proj ..."
                      f" layers.{cfg.num_layers - 1}.mlp.down_proj): the recipe is for another model; {FIX_MODEL}.")


def _format(rows, path: str) -> QuantFormat | None:
  """The format of the module `path` (opdjax naming) under first-match-wins rows; None if unmatched."""
  return next((QuantFormat.parse(f) for pat, f in rows if fnmatch.fnmatchcase(path, pat)), None)


def _quantized(fmt: QuantFormat | None) -> bool:
  return fmt is not None and fmt.name not in _UNQUANTIZED


def scheme(recipe: Recipe, where: str = "rollout.vllm.recipe") -> str | None:
  """vLLM's online shorthand for the recipe's one quantized format (None: nothing quantized)."""
  formats = sorted({str(QuantFormat.parse(f)) for _, f in recipe.rows if _quantized(QuantFormat.parse(f))})
  if len(formats) > 1:
    raise UserError(f"{where}: {recipe.source} mixes {', '.join(formats)}; a vLLM server quantizes every matrix one"
                    f" way (one --quantization); {FIX_FORMAT}.")
  if formats and formats[0] not in ONLINE_SCHEMES:
    raise UserError(f"{where}: {recipe.source} quantizes to {formats[0]}, which vLLM's online quantization does not"
                    f" produce (FP8 e4m3 only, per-tensor, per-channel or 128x128 blocks); {FIX_FORMAT}.")
  return ONLINE_SCHEMES[formats[0]] if formats else None


def bf16_layers(recipe: Recipe, cfg: ModelConfig) -> tuple[int, ...]:
  """Layers whose every matrix the recipe keeps in bf16 (or fp32)."""
  quantized = {int(name.split(".")[2]) for name in linear_modules(cfg)  # model.layers.{i}.*
               if _quantized(_format(recipe.rows, name.removeprefix("model.")))}
  return tuple(i for i in range(cfg.num_layers) if i not in quantized)


def kv_bf16_layers(recipe: Recipe, cfg: ModelConfig, where: str = "rollout.vllm.recipe") -> tuple[int, ...]:
  """The layers whose KV cache the recipe keeps in bf16 (checked against the model first)."""
  _check_model(recipe, cfg, where)
  if recipe.kv_layers is None:
    return bf16_layers(recipe, cfg)
  bad = [i for i in recipe.kv_layers if not 0 <= i < cfg.num_layers]
  if bad:
    raise UserError(f"{where}: {recipe.source} keeps the KV cache of layer(s) {bad} in bf16, but the served model has"
                    f" {cfg.num_layers} layers (0..{cfg.num_layers - 1}); {FIX_MODEL}.")
  return recipe.kv_layers


def translate(recipe: Recipe, cfg: ModelConfig, where: str = "rollout.vllm.recipe") -> VllmRecipe:
  """The recipe as vLLM configures it, for the model `cfg`; every recipe vLLM would serve differently is refused."""
  kv = kv_bf16_layers(recipe, cfg, where)
  quantization = scheme(recipe, where)
  heads = ["embed_tokens"] + ([] if cfg.tie_word_embeddings else ["lm_head"])
  for head in heads:
    if _quantized(_format(recipe.rows, head)):
      raise UserError(f"{where}: {recipe.source} quantizes {head}, which vLLM's online FP8 keeps in bf16 (it"
                      f" quantizes linear layers only); start the recipe with 'embed_tokens>bf16|lm_head>bf16', as"
                      " `opdjax sensitivity` does.")

  def served(name):  # "bf16" or the quantized format of an HF module name
    fmt = _format(recipe.rows, name.removeprefix("model."))
    return str(fmt) if _quantized(fmt) else "bf16"

  names = linear_modules(cfg)
  first_shard = {shards[0]: fused for fused, shards in FUSED.items()}  # each fused matrix checked once
  for name in names:
    module, proj = name.rsplit(".", 1)
    if proj in first_shard:
      fused = first_shard[proj]
      fmts = {s: served(f"{module}.{s}") for s in FUSED[fused]}
      if len(set(fmts.values())) > 1:
        raise UserError(f"{where}: {recipe.source} gives {module}'s {', '.join(f'{s} {f}' for s, f in fmts.items())};"
                        f" vLLM multiplies them as one matrix ({fused}): give them one format.")
  ignore = tuple(n for n in names if served(n) == "bf16")
  return VllmRecipe(quantization if len(ignore) < len(names) else None, ignore, kv, cfg.num_layers)


# --- the server --------------------------------------------------------------------------------

def check_config(vcfg, where: str = "rollout.vllm.recipe") -> Recipe:
  """What `rollout.vllm` can say wrong about a recipe before any model is read: the file, the format, the
  dtype (vLLM's online FP8 computes in bf16), flags the recipe sets given a second time."""
  recipe = load(vcfg.recipe, where)
  scheme(recipe, where)
  if vcfg.dtype not in ("bfloat16", "auto"):  # auto: bf16 on the GPU FP8 needs (gpu_defaults.resolve)
    raise UserError(f"{where} with rollout.vllm.dtype={vcfg.dtype!r}: the recipe serves its unquantized layers in bf16"
                    " and vLLM's online FP8 takes bf16 activations; set rollout.vllm.dtype=bfloat16 (or auto).")
  for key, value in (("quantization", vcfg.quantization), ("kv_cache_dtype", vcfg.kv_cache_dtype)):
    if value:
      raise UserError(f"{where} sets the server's --quantization and --kv-cache-dtype; leave rollout.vllm.{key} empty"
                      f" (now {value!r}), or drop the recipe.")
  flags = {a.split("=", 1)[0] for a in shlex.split(vcfg.extra_args)}
  clash = sorted(flags & set(RECIPE_FLAGS))
  if clash:
    raise UserError(f"{where} sets {', '.join(clash)}; remove them from rollout.vllm.extra_args.")
  return recipe


def server_args(vcfg, model_dir: str) -> list[str]:
  """The `vllm serve` flags of `vcfg.recipe` for the model in `model_dir` (its config.json); [] without one."""
  if not vcfg.recipe:
    return []
  recipe = check_config(vcfg)
  return translate(recipe, ModelConfig.from_pretrained(model_dir)).args()
