"""Model configuration, read from a Hugging Face `config.json`.

One decoder covers the Llama, Qwen2 and Qwen3 families; they differ only in the
switches below (q/k/v bias, per-head q/k RMSNorm, tied embeddings, head_dim).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from opdjax.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


class UnsupportedModelError(UserError):
  """A config asks for a family or option this decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  # The switches below default (None) to what `model_type` implies; a combination the family's
  # HF checkpoints cannot express is an error.
  attention_bias: bool | None = None  # bias on q/k/v projections (Qwen2: always on)
  o_proj_bias: bool | None = None  # Llama's and Qwen3's `attention_bias` also bias o_proj; Qwen2 never
  mlp_bias: bool = False  # Llama only
  qk_norm: bool | None = None  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # Compute dtype for matmuls; logits are always returned in fp32.
  dtype: str = "float32"
  # KV-cache quantization (an engine setting, never saved): keys and values are rounded through
  # FP8 as they are written; `static` uses scale 1 (vLLM without calibrated scales), `per_head` a
  # dynamic absmax scale per token and kv head. A full forward with the same setting reproduces
  # the decoding engine's numerics exactly, which is what re-scoring needs.
  kv_quant: str = "none"  # none | fp8_e4m3 | fp8_e5m2
  kv_scale: str = "per_head"  # static | per_head
  # Activation quantization at every projection's input (W8A8 engines), per-token absmax scale.
  act_quant: str = "none"  # none | fp8_e4m3 | int8
  # Engine/runtime settings below change how, not what, the model computes (never saved).
  # Attention kernel for training and prefill: `auto` is cuDNN's fused attention on a GPU when it
  # takes the dtype and head_dim (else XLA's, with a notice), XLA's on other backends.
  attention_impl: str = "auto"  # auto | xla | cudnn
  # Packed FP8 (e4m3, per-tensor or per-channel scales) layer weights are multiplied as fp8 with
  # fp8 activations (per-token scales) instead of being dequantized first: W8A8 on FP8 tensor
  # cores (compute capability >= 8.9). Needs act_quant="fp8_e4m3", the numerics it computes.
  fp8_matmul: bool = False
  # The pair's shared tokenizer has ids [0, shared_vocab) (a runtime setting, never saved; 0: every row).
  # Embedding rows beyond it are padding (Qwen2.5-7B has 152064 rows for a 151665-token tokenizer): logits,
  # and so every softmax, KL and sample, cover the tokenizer's ids only (opdjax.models.vocab).
  shared_vocab: int = 0

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise UnsupportedModelError(
          f"model_type {self.model_type!r} is not supported; opdjax's decoder"
          f" implements {', '.join(SUPPORTED_MODEL_TYPES)}."
      )
    attn_bias = self.model_type == "qwen2" if self.attention_bias is None else self.attention_bias
    want = {"qwen2": (True, False, False), "qwen3": (attn_bias, attn_bias, True),
            "llama": (attn_bias, attn_bias, False)}[self.model_type]
    for name, default in zip(("attention_bias", "o_proj_bias", "qk_norm"), want):
      if getattr(self, name) is None:
        object.__setattr__(self, name, default)
    if (self.attention_bias, self.o_proj_bias, self.qk_norm) != want or (self.mlp_bias and self.model_type != "llama"):
      raise UnsupportedModelError(
          f"{self.model_type} cannot express attention_bias={self.attention_bias}, o_proj_bias={self.o_proj_bias},"
          f" qk_norm={self.qk_norm}, mlp_bias={self.mlp_bias}: its checkpoints would not load in transformers."
          f" For {self.model_type} use attention_bias/o_proj_bias/qk_norm = {want}"
          + (" (o_proj_bias equals attention_bias)." if self.model_type != "qwen2" else "."))
    if self.kv_quant not in ("none", "fp8_e4m3", "fp8_e5m2") or self.kv_scale not in ("static", "per_head"):
      raise UnsupportedModelError(
          f"kv_quant={self.kv_quant!r}, kv_scale={self.kv_scale!r}: choose kv_quant in none/fp8_e4m3/fp8_e5m2"
          " and kv_scale in static/per_head.")
    if self.act_quant not in ("none", "fp8_e4m3", "int8"):
      raise UnsupportedModelError(f"act_quant={self.act_quant!r}: choose none, fp8_e4m3 or int8.")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise UnsupportedModelError(f"attention_impl={self.attention_impl!r}: choose {', '.join(ATTENTION_IMPLS)}.")
    if self.fp8_matmul and self.act_quant != "fp8_e4m3":
      raise UnsupportedModelError(
          f"fp8_matmul=True multiplies fp8 activations, but act_quant={self.act_quant!r}: set"
          " act_quant='fp8_e4m3' (the W8A8 numerics it computes) or turn fp8_matmul off.")
    if not 0 <= self.shared_vocab <= self.vocab_size:
      raise UnsupportedModelError(f"shared_vocab={self.shared_vocab} is outside [0, vocab_size={self.vocab_size}].")
    if self.num_heads % self.num_kv_heads:
      raise UnsupportedModelError(
          f"num_attention_heads={self.num_heads} is not a multiple of"
          f" num_key_value_heads={self.num_kv_heads}."
      )

  @property
  def eos_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  @property
  def logit_size(self) -> int:
    """How many logits the model computes: the shared tokenizer's ids (padded embedding rows excluded)."""
    return self.shared_vocab or self.vocab_size

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  # --- Hugging Face interop -------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise UnsupportedModelError(
          f"model_type {model_type!r} is not supported; opdjax's decoder"
          f" implements {', '.join(SUPPORTED_MODEL_TYPES)}."
      )
    _check_unsupported(d)
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    head_dim = d.get("head_dim") or hidden // heads
    rope_theta = d.get("rope_theta")
    if rope_theta is None:  # transformers v5 moves it into rope_parameters
      rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    attn_bias = bool(d.get("attention_bias", False))
    eos = d.get("eos_token_id")
    return cls(
        model_type=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else attn_bias,
        o_proj_bias=attn_bias if model_type in ("llama", "qwen3") else False,
        mlp_bias=bool(d.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=d.get("pad_token_id"),
    )

  def to_hf_dict(self) -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    d = {
        "architectures": [arch[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "torch_dtype": self.dtype,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        "pad_token_id": self.pad_token_id,
    }
    if self.model_type == "llama":
      d["attention_bias"] = self.attention_bias
      d["mlp_bias"] = self.mlp_bias
    if self.model_type == "qwen3":
      d["attention_bias"] = self.attention_bias
    return d

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
      raise FileNotFoundError(
          f"{cfg_path} not found: pass a Hugging Face model folder containing"
          " config.json and *.safetensors."
      )
    with open(cfg_path) as f:
      return cls.from_hf_dict(json.load(f))


def _check_unsupported(d: dict[str, Any]) -> None:
  act = d.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu').")
  scaling = d.get("rope_scaling")
  rope_params = d.get("rope_parameters") or {}
  rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or rope_params.get("rope_type")
  if rope_type not in (None, "default"):
    raise UnsupportedModelError(
        f"rope scaling {rope_type!r} is not supported; only default RoPE is implemented."
    )
  if d.get("use_sliding_window") and d.get("sliding_window"):
    raise UnsupportedModelError("sliding-window attention is not supported; set use_sliding_window=false.")
