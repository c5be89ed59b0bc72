"""llama.cpp GGUF (llama architecture) -> Hugging Face safetensors folder with tokenizer.

Tensors are dequantized to fp32 with the `gguf` package, renamed through `GGUF_NAMES` onto the
HF names of `hf_io.PARAM_TABLE` (so opdjax's params and the saved folder share one table), and
written by `save_hf_params`. The tokenizer (byte-level BPE), its special tokens and the chat
template are rebuilt from the file's metadata with `tokenizers`, so converting needs no torch.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from opdjax.errors import UserError
from opdjax.models.config import ModelConfig
from opdjax.models.hf_io import from_hf, hf_names, save_hf_params

# GGUF tensor name (without `blk.{i}.` and without `.weight`/`.bias`) -> HF module name.
GGUF_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "model.layers.{i}.input_layernorm",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "attn_q": "model.layers.{i}.self_attn.q_proj",
    "attn_k": "model.layers.{i}.self_attn.k_proj",
    "attn_v": "model.layers.{i}.self_attn.v_proj",
    "attn_output": "model.layers.{i}.self_attn.o_proj",
    "ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "ffn_up": "model.layers.{i}.mlp.up_proj",
    "ffn_down": "model.layers.{i}.mlp.down_proj",
}

_CONTROL_TOKEN = 3  # llama.cpp's token_type for special tokens such as <|im_start|>

# tokenizer.ggml.pre -> split digits one by one before the byte-level BPE (as the HF tokenizer does).
_BPE_PRE_TOKENIZERS = {"gpt2": False, "smollm": True}


def hf_name(gguf_name: str) -> str | None:
  """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if not in the table."""
  stem, _, kind = gguf_name.rpartition(".")
  layer = None
  if stem.startswith("blk."):
    _, layer, stem = stem.split(".", 2)
  module = GGUF_NAMES.get(stem)
  if module is None or kind not in ("weight", "bias") or ("{i}" in module) != (layer is not None):
    return None
  return f"{module.format(i=layer)}.{kind}"


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Restores HF's row order of a q or k projection (weight or bias) stored by llama.cpp.

  HF's RoPE rotates the pairs (j, j + E/2) of each head; llama.cpp's rotates adjacent pairs
  (2j, 2j + 1), so its converter moves HF row j to row 2j and row j + E/2 to row 2j + 1.
  """
  e = w.shape[0] // n_heads
  hf_from_gguf = np.arange(e).reshape(e // 2, 2).T.reshape(-1)  # [0, 2, 4, ..., 1, 3, 5, ...]
  return w.reshape(n_heads, e, *w.shape[1:])[:, hf_from_gguf].reshape(w.shape)


def read_metadata(reader) -> dict[str, Any]:
  return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _f32(x) -> float:
  return float(str(np.float32(x)))  # 9.999999747e-06 stored as float32 -> 1e-05, as HF writes it


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise UserError(f"GGUF architecture {arch!r} is not supported; only 'llama' files convert.")
  scaling = meta.get("llama.rope.scaling.type")
  if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
    raise UserError("this GGUF uses RoPE scaling, which opdjax's decoder does not implement.")
  hidden = int(meta["llama.embedding_length"])
  heads = int(meta["llama.attention.head_count"])
  head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
  if int(meta.get("llama.rope.dimension_count", head_dim)) != head_dim:
    raise UserError("this GGUF rotates only part of each head (partial RoPE), which opdjax does not implement.")
  bias = "blk.0.attn_q.bias" in tensor_names
  return ModelConfig(
      model_type="llama",
      vocab_size=int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
      hidden_size=hidden,
      intermediate_size=int(meta["llama.feed_forward_length"]),
      num_layers=int(meta["llama.block_count"]),
      num_heads=heads,
      num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
      head_dim=head_dim,
      rope_theta=_f32(meta.get("llama.rope.freq_base", 10000.0)),
      rms_norm_eps=_f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings="output.weight" not in tensor_names,
      attention_bias=bias,
      o_proj_bias=bias,
      mlp_bias="blk.0.ffn_up.bias" in tensor_names,
      max_position_embeddings=int(meta.get("llama.context_length", 4096)),
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
      pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
  )


def _dequantize(tensor) -> np.ndarray:
  from gguf.quants import dequantize

  try:
    w = dequantize(tensor.data, tensor.tensor_type)
  except NotImplementedError as e:
    raise UserError(f"{tensor.name}: the gguf package cannot dequantize {tensor.tensor_type.name}: {e}") from e
  return np.asarray(w, np.float32).reshape([int(d) for d in reversed(tensor.shape)])


def params_from_gguf(reader, cfg: ModelConfig, progress: bool = False) -> dict[str, Any]:
  """Dequantized fp32 params (NumPy leaves) in opdjax's tree, q/k rows back in HF order."""
  from opdjax.progress import bar as progress_bar

  hf = {}
  for t in progress_bar(reader.tensors, desc="converting GGUF", enabled=progress, unit="tensor", leave=False):
    name = hf_name(t.name)
    if name is None:
      raise UserError(f"GGUF tensor {t.name!r} has no place in a Llama decoder; this file cannot be converted.")
    w = _dequantize(t)
    if ".q_proj." in name:
      w = unpermute_rope(w, cfg.num_heads)
    elif ".k_proj." in name:
      w = unpermute_rope(w, cfg.num_kv_heads)
    hf[name] = w
  missing = [name for name in hf_names(cfg) if name not in hf]
  if missing:
    raise UserError(f"GGUF file lacks the tensor for {missing[0]}; it is not a complete Llama checkpoint.")
  unused = sorted(set(hf) - set(hf_names(cfg)))
  if unused:
    raise UserError(f"GGUF tensors this config does not use: {unused[:5]}")
  return from_hf(hf, cfg)


def tokenizer_from_metadata(meta: dict[str, Any]):
  """A `PreTrainedTokenizerFast` with the file's vocabulary, merges, special tokens and chat template."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast

  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
  if kind != "gpt2" or pre not in _BPE_PRE_TOKENIZERS:
    raise UserError(
        f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported; opdjax rebuilds byte-level BPE"
        f" tokenizers with pre-tokenizer {' or '.join(sorted(_BPE_PRE_TOKENIZERS))}.")
  tokens = list(meta["tokenizer.ggml.tokens"])
  # A merge is "left right"; llama.cpp splits at the first space after the first character.
  merges = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1:]) for m in meta["tokenizer.ggml.merges"]]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                       if _BPE_PRE_TOKENIZERS[pre] else byte_level)
  tok.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == _CONTROL_TOKEN])

  def special(key):
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if i is None else tokens[i]

  bos, bos_id = special("bos"), meta.get("tokenizer.ggml.bos_token_id")
  if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  fast = PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=bos, eos_token=special("eos"), unk_token=special("unknown"),
      pad_token=special("padding"), clean_up_tokenization_spaces=False,
      model_max_length=int(meta.get("llama.context_length", 4096)))
  if "tokenizer.chat_template" in meta:
    fast.chat_template = meta["tokenizer.chat_template"]
  return fast


def convert_gguf(gguf_path: str, out_dir: str, progress: bool = False) -> str:
  """Writes `out_dir` (config.json, model.safetensors in fp32, tokenizer files with chat template).

  Staged in a temporary folder beside `out_dir` and renamed into place, so a crash never leaves a
  folder that looks complete. Returns `out_dir`.
  """
  from gguf import GGUFReader

  if os.path.exists(out_dir) and os.listdir(out_dir):
    raise FileExistsError(f"{out_dir} exists and is not empty; choose a new folder (nothing was overwritten).")
  if not os.path.isfile(gguf_path):
    raise FileNotFoundError(f"{gguf_path} not found: pass a .gguf file.")
  reader = GGUFReader(gguf_path)
  meta = read_metadata(reader)
  cfg = config_from_metadata(meta, {t.name for t in reader.tensors})
  tokenizer = tokenizer_from_metadata(meta)  # fails early, before the slow part, on an unsupported tokenizer
  params = params_from_gguf(reader, cfg, progress)
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix=".tmp-gguf-", dir=parent) as tmp:
    stage = os.path.join(tmp, "hf")
    save_hf_params(params, cfg, stage)
    tokenizer.save_pretrained(stage)
    if os.path.exists(out_dir):
      os.rmdir(out_dir)
    os.replace(stage, out_dir)
  return out_dir
