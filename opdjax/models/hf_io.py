"""Hugging Face safetensors <-> opdjax params, through one declarative table.

Each row maps an opdjax param path to the HF tensor name; `T` marks a Linear weight, stored
`[out, in]` by HF and `[in, out]` by Flax. A row whose HF name has `{i}` is a decoder-layer tensor:
opdjax holds the L layers' tensors stacked on a leading axis under `layers/` (the scanned decoder),
HF one tensor per layer (`model.layers.{i}.`). Rows whose tensor a config does not have (biases,
q/k norms, lm_head when tied) are skipped by `_present`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from opdjax.models.config import ModelConfig

# (opdjax path, HF name, transpose)
PARAM_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("embed_tokens/embedding", "model.embed_tokens.weight", False),
    ("norm/weight", "model.norm.weight", False),
    ("lm_head/kernel", "lm_head.weight", True),
    ("layers/input_layernorm/weight", "model.layers.{i}.input_layernorm.weight", False),
    ("layers/post_attention_layernorm/weight", "model.layers.{i}.post_attention_layernorm.weight", False),
    ("layers/self_attn/q_proj/kernel", "model.layers.{i}.self_attn.q_proj.weight", True),
    ("layers/self_attn/k_proj/kernel", "model.layers.{i}.self_attn.k_proj.weight", True),
    ("layers/self_attn/v_proj/kernel", "model.layers.{i}.self_attn.v_proj.weight", True),
    ("layers/self_attn/o_proj/kernel", "model.layers.{i}.self_attn.o_proj.weight", True),
    ("layers/self_attn/q_proj/bias", "model.layers.{i}.self_attn.q_proj.bias", False),
    ("layers/self_attn/k_proj/bias", "model.layers.{i}.self_attn.k_proj.bias", False),
    ("layers/self_attn/v_proj/bias", "model.layers.{i}.self_attn.v_proj.bias", False),
    ("layers/self_attn/o_proj/bias", "model.layers.{i}.self_attn.o_proj.bias", False),
    ("layers/self_attn/q_norm/weight", "model.layers.{i}.self_attn.q_norm.weight", False),
    ("layers/self_attn/k_norm/weight", "model.layers.{i}.self_attn.k_norm.weight", False),
    ("layers/mlp/gate_proj/kernel", "model.layers.{i}.mlp.gate_proj.weight", True),
    ("layers/mlp/up_proj/kernel", "model.layers.{i}.mlp.up_proj.weight", True),
    ("layers/mlp/down_proj/kernel", "model.layers.{i}.mlp.down_proj.weight", True),
    ("layers/mlp/gate_proj/bias", "model.layers.{i}.mlp.gate_proj.bias", False),
    ("layers/mlp/up_proj/bias", "model.layers.{i}.mlp.up_proj.bias", False),
    ("layers/mlp/down_proj/bias", "model.layers.{i}.mlp.down_proj.bias", False),
)


def _present(cfg: ModelConfig, jax_path: str) -> bool:
  if jax_path.startswith("lm_head"):
    return not cfg.tie_word_embeddings
  if "/mlp/" in jax_path and jax_path.endswith("bias"):
    return cfg.mlp_bias
  if "o_proj/bias" in jax_path:
    return cfg.o_proj_bias
  if jax_path.endswith("proj/bias"):
    return cfg.attention_bias
  if "q_norm" in jax_path or "k_norm" in jax_path:
    return cfg.qk_norm
  return True


def _rows(cfg: ModelConfig):
  return [row for row in PARAM_TABLE if _present(cfg, row[0])]


def hf_names(cfg: ModelConfig) -> list[str]:
  """Every HF tensor name this config has."""
  return [hf.format(i=i) for _, hf, _ in _rows(cfg) for i in (range(cfg.num_layers) if "{i}" in hf else [None])]


def _set(tree: dict, path: str, value) -> None:
  keys = path.split("/")
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def _get(tree: dict, path: str):
  for k in path.split("/"):
    tree = tree[k]
  return tree


def from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, dtype=np.float32) -> dict[str, Any]:
  """opdjax params (NumPy leaves) from HF-named tensors; every name of `hf_names(cfg)` must be there."""

  def one(name, transpose):
    w = np.asarray(tensors[name]).astype(dtype)
    return w.T if transpose else w

  params: dict[str, Any] = {}
  for jp, hf, transpose in _rows(cfg):
    if "{i}" in hf:
      _set(params, jp, np.stack([one(hf.format(i=i), transpose) for i in range(cfg.num_layers)]))
    else:
      _set(params, jp, one(hf, transpose))
  return params


def to_hf(params, cfg: ModelConfig, dtype=np.float32) -> dict[str, np.ndarray]:
  """HF-named tensors (HF's `[out, in]` layout, one per layer) from opdjax params."""
  out = {}
  for jp, hf, transpose in _rows(cfg):
    w = np.asarray(jax.device_get(_get(params, jp))).astype(dtype)
    for i in range(cfg.num_layers) if "{i}" in hf else [None]:
      x = w if i is None else w[i]
      out[hf.format(i=i) if i is not None else hf] = np.ascontiguousarray(x.T if transpose else x)
  return out


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(
        f"no *.safetensors in {path}: opdjax loads safetensors only (never pickle);"
        " convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True)."
    )
  tensors: dict[str, np.ndarray] = {}
  for fname in files:
    tensors.update(_load_any_dtype(os.path.join(path, fname)))
  return tensors


def _load_any_dtype(file: str) -> dict[str, np.ndarray]:
  try:
    return load_file(file)
  except TypeError:  # bf16 is not a numpy dtype: go through ml_dtypes via flax's reader
    from safetensors.flax import load_file as load_flax
    return {k: np.asarray(v) for k, v in load_flax(file).items()}


def load_hf_params(path: str, cfg: ModelConfig | None = None, dtype=np.float32):
  """Reads an HF safetensors folder (single file or sharded) into an opdjax params pytree."""
  cfg = cfg or ModelConfig.from_pretrained(path)
  tensors = _read_tensors(path)
  missing = [name for name in hf_names(cfg) if name not in tensors]
  if missing:
    raise ValueError(f"{path}: missing tensors for this config: {missing[:5]}{'...' if len(missing) > 5 else ''}")
  return jax.tree.map(jax.numpy.asarray, from_hf(tensors, cfg, dtype))


def save_hf_params(params, cfg: ModelConfig, path: str, extra_files: dict[str, str] | None = None,
                   dtype=np.float32) -> None:
  """Writes `config.json` + `model.safetensors` that transformers and vLLM load.

  Written to a temporary folder first and renamed into place, so a crash never
  leaves a folder that looks complete.
  """
  if os.path.exists(path) and os.listdir(path):
    raise FileExistsError(f"{path} exists and is not empty; choose a new folder (nothing was overwritten).")
  tensors = to_hf(params, cfg, dtype)
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent)
  save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
  hf_cfg = cfg.to_hf_dict()
  hf_cfg["torch_dtype"] = np.dtype(dtype).name
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)
  for name, text in (extra_files or {}).items():
    with open(os.path.join(tmp, name), "w") as f:
      f.write(text)
  try:
    if os.path.exists(path):
      os.rmdir(path)  # (empty: checked above)
    os.replace(tmp, path)
  except OSError as e:  # another process wrote `path` meanwhile (two trainer processes building one cache entry)
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.isdir(path) and os.listdir(path):
      raise FileExistsError(f"{path} was written by another process meanwhile (nothing was overwritten).") from e
    raise
