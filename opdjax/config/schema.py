"""The typed config: one frozen dataclass per section, built once from a `configs/*.py` file plus
`--config.a.b=v` overrides and validated there. A ConfigDict never goes past `build()`.

Every error names the key and the valid choices. `Config.to_dict()` is what `config.json`,
checkpoints and budget files record; `build(to_dict(c))` gives `c` back.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import typing
from typing import Any

import ml_collections

from opdjax.config.loader import ConfigError
from opdjax.errors import UserError
from opdjax.models.decoder import REMAT_POLICIES
from opdjax.rollout.base import SamplingParams
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig

ENGINES = ("jax", "vllm")
DTYPES = ("float32", "bfloat16")
NONFINITE = ("halt", "skip")
TASKS = ("addition", "prompts")
BEST_METRICS = ("", "reverse_kl", "accuracy")
ASYNC_MODES = ("exact", "bounded")
GUARDS = ("warn", "backoff", "halt")


def _choice(key: str, value, choices) -> None:
  if value not in choices:
    raise UserError(f"{key}={value!r}; choose one of {', '.join(repr(c) for c in choices)}.")


def _positive(key: str, value, minimum=1) -> None:
  if value < minimum:
    raise UserError(f"{key}={value}: must be >= {minimum}.")


def _views(key: str, spec: str, sep: str = ";") -> None:
  from opdjax.views.view import EngineView

  for item in spec.split(sep):
    try:
      EngineView.parse(item)
    except UserError as e:
      raise UserError(f"{key}: {e}") from None


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """`addition` (built-in, exact verifier) or `prompts` (`path`: a JSONL of prompts, or builtin:NAME)."""

  name: str = "addition"
  max_digits: int = 2
  num_eval: int = 256
  path: str = ""
  chat_template: bool = False

  def check(self):
    _choice("task.name", self.name, TASKS)
    _positive("task.num_eval", self.num_eval)
    if self.name == "prompts":
      if not self.path:
        raise UserError("task.path is empty: task.name='prompts' needs a JSONL of prompts (or builtin:NAME).")
      if not self.path.startswith("builtin:") and not os.path.exists(self.path):
        raise UserError(f"task.path={self.path!r} does not exist; give a JSONL file of prompts.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Compute dtype of both models' matmuls (params stay fp32; logits and KL are always fp32) and the
  rematerialisation policy of the scanned layers."""

  dtype: str = "float32"
  remat_policy: str = "nothing"

  def check(self):
    _choice("model.dtype", self.dtype, DTYPES)
    _choice("model.remat_policy", self.remat_policy, REMAT_POLICIES)


def _check_path(role: str, path: str) -> None:
  if path and not path.startswith("fetch:") and not os.path.isdir(path):
    raise UserError(f"{role}.path={path!r} is not a folder; give a Hugging Face safetensors folder or"
                    " fetch:NAME (see `opdjax models fetch`).")


@dataclasses.dataclass(frozen=True)
class StudentConfig:
  """`path`: an HF folder or `fetch:NAME`; empty builds the demo's model (addition task only).
  `keep_layers` prunes a loaded model (`0::2` keeps every other layer). The rest size the demo model."""

  path: str = ""
  keep_layers: str = ""
  hidden_size: int = 32
  num_layers: int = 2
  num_heads: int = 4
  sft_steps: int = 100
  sft_batch: int = 64
  sft_lr: float = 3e-3

  def check(self, role: str = "student"):
    _check_path(role, self.path)


@dataclasses.dataclass(frozen=True)
class TeacherConfig(StudentConfig):
  """As the student's, plus `view`: score with a perturbed teacher (e.g. `weights=fp8`)."""

  view: str = "clean"
  hidden_size: int = 64
  sft_steps: int = 1200

  def check(self, role: str = "teacher"):
    super().check(role)
    _views("teacher.view", self.view, sep="\0")
    from opdjax.views.view import EngineView

    if EngineView.parse(self.view).lag:
      raise UserError("teacher.view cannot have a lag: the teacher never changes.")


@dataclasses.dataclass(frozen=True)
class VllmConfig:
  """rollout.engine='vllm': a vLLM server (started here, or `url` to attach) samples; weights are
  synced every step. quantization / kv_cache_dtype ('fp8') need a GPU. `extra_args`: more
  `vllm serve` flags, shell-quoted (e.g. '--max-num-seqs 128'). Several servers: `urls` (attach,
  comma-separated) or `num_servers` (started here, `tensor_parallel_size` GPUs each, taken in order
  from `gpus` when given): prompts are spread across them (opdjax.rollout.vllm.multi)."""

  url: str = ""
  urls: str = ""
  num_servers: int = 1
  gpus: str = ""
  dtype: str = "float32"
  quantization: str = ""
  kv_cache_dtype: str = ""
  gpu_memory_utilization: float = 0.0
  tensor_parallel_size: int = 1
  enforce_eager: bool = True
  api_key: str = ""
  python: str = ""
  cpu_kvcache_gib: int = 1
  extra_args: str = ""
  recipe: str = ""  # recipe.json of `opdjax sensitivity` (or its view): FP8 weights and KV (rollout.vllm.recipe)

  @property
  def extra_argv(self) -> tuple[str, ...]:
    return tuple(shlex.split(self.extra_args))

  def check(self):
    _positive("rollout.vllm.tensor_parallel_size", self.tensor_parallel_size)
    _positive("rollout.vllm.num_servers", self.num_servers)
    urls = [u for u in self.urls.split(",") if u.strip()]
    if urls and (self.url or self.num_servers > 1):
      raise UserError(f"rollout.vllm.urls={self.urls!r} attaches to running servers; leave rollout.vllm.url empty and"
                      " rollout.vllm.num_servers=1 (it counts servers opdjax starts), or give the one url alone.")
    if self.url and self.num_servers > 1:
      raise UserError(f"rollout.vllm.url={self.url!r} with rollout.vllm.num_servers={self.num_servers}: list the"
                      " running servers in rollout.vllm.urls, or leave url empty to start num_servers here.")
    gpus = [g for g in self.gpus.split(",") if g.strip()]
    if gpus and len(gpus) != self.num_servers * self.tensor_parallel_size:
      need = self.num_servers * self.tensor_parallel_size
      raise UserError(f"rollout.vllm.gpus={self.gpus!r} lists {len(gpus)} GPUs; {self.num_servers} server(s) x"
                      f" tensor_parallel_size={self.tensor_parallel_size} need {need}.")
    try:
      shlex.split(self.extra_args)
    except ValueError as e:
      raise UserError(f"rollout.vllm.extra_args={self.extra_args!r}: {e}; quote it as for a shell.") from None
    if self.recipe:
      from opdjax.rollout.vllm.recipe import check_config

      check_config(self)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """`async_depth` k > 0: a producer samples while the trainer trains, at most k params versions
  behind (opdjax.pipeline.async_sampler); `async_mode` exact (always k behind: equals the `lag=k`
  view bitwise) or bounded (the newest params within k). `devices`: the local device index the JAX
  engine's producer samples on (default: the last one that is not the trainer's)."""

  engine: str = "jax"
  view: str = "clean"
  batch_size: int = 64
  vllm: VllmConfig = VllmConfig()
  max_new_tokens: int = 6
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_len: int = 32
  async_depth: int = 0
  async_mode: str = "exact"
  devices: str = ""

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                          top_k=self.top_k)

  def check(self):
    _choice("rollout.engine", self.engine, ENGINES)
    _views("rollout.view", self.view, sep="\0")
    _positive("rollout.batch_size", self.batch_size)
    try:
      _ = self.sampling
    except UserError as e:
      raise UserError(f"rollout.{e}") from None
    if self.max_len <= self.max_new_tokens:
      raise UserError(f"rollout.max_len={self.max_len} must exceed rollout.max_new_tokens={self.max_new_tokens}"
                      " (the prompt needs room).")
    if self.engine == "vllm":
      from opdjax.views.view import EngineView

      v = EngineView.parse(self.view)
      bad = [k for k in ("compute_dtype", "kv_quant", "act_quant") if getattr(v, k) != getattr(EngineView(), k)]
      if bad:
        raise UserError(f"rollout.view={self.view} sets {', '.join(bad)} with rollout.engine='vllm': vLLM's own"
                        " precision is set by rollout.vllm.dtype / kv_cache_dtype / quantization; the view may only"
                        " change weights, noise and lag.")
    self.vllm.check()
    self._check_async()

  def _check_async(self):
    from opdjax.views.view import EngineView

    if self.async_depth < 0:
      raise UserError(f"rollout.async_depth={self.async_depth}: must be >= 0 (0 samples synchronously, k > 0 lets"
                      " the producer run k params versions ahead).")
    _choice("rollout.async_mode", self.async_mode, ASYNC_MODES)
    lag = EngineView.parse(self.view).lag
    if lag and self.async_depth:
      raise UserError(f"rollout.view={self.view} has lag={lag} and rollout.async_depth={self.async_depth}: give the"
                      f" staleness once (rollout.async_depth={lag} with async_mode='exact' equals lag={lag}).")
    if self.devices:
      if not self.async_depth:
        raise UserError(f"rollout.devices={self.devices!r} places the asynchronous producer; set"
                        " rollout.async_depth > 0, or leave rollout.devices empty.")
      if self.engine != "jax":
        raise UserError(f"rollout.devices={self.devices!r}: only the JAX engine samples on this process's devices;"
                        " leave it empty with rollout.engine='vllm'.")
      if not all(x.strip().isdigit() for x in self.devices.split(",")):
        raise UserError(f"rollout.devices={self.devices!r}: give a device index (e.g. '1'), as in jax.local_devices().")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Checkpoints (Orbax) go to OUT/checkpoints every `checkpoint_every` steps and at the end; the same
  --out resumes from the latest. on_nonfinite: halt (keep the last good checkpoint) or skip.
  tensorboard: also write TensorBoard event files under OUT/tensorboard/.
  budget: a budget.json of `opdjax calibrate`; `guard` compares the mean of the last `guard_window`
  steps' mismatch with it: warn, backoff (lower rollout.async_depth, then switch to `guard_view`)
  or halt (opdjax.pipeline.guard)."""

  steps: int = 800
  eval_every: int = 1
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  best_metric: str = "reverse_kl"
  on_nonfinite: str = "halt"
  tensorboard: bool = False
  budget: str = ""
  guard: str = "warn"
  guard_view: str = ""
  guard_window: int = 5

  def check(self):
    _positive("train.steps", self.steps)
    _positive("train.eval_every", self.eval_every)
    _positive("train.checkpoint_every", self.checkpoint_every, 0)
    _positive("train.keep_checkpoints", self.keep_checkpoints)
    _choice("train.best_metric", self.best_metric, BEST_METRICS)
    _choice("train.on_nonfinite", self.on_nonfinite, NONFINITE)
    _choice("train.guard", self.guard, GUARDS)
    _positive("train.guard_window", self.guard_window)
    if self.budget and not os.path.isfile(self.budget):
      raise UserError(f"train.budget={self.budget!r} does not exist; write one with `opdjax calibrate --out DIR`"
                      " (DIR/budget.json), or leave train.budget empty.")
    if self.guard != "warn" and not self.budget:
      raise UserError(f"train.guard={self.guard!r} needs train.budget=PATH (a budget.json of `opdjax calibrate`).")
    if self.guard_view:
      if self.guard != "backoff":
        raise UserError(f"train.guard_view={self.guard_view!r} is the view train.guard='backoff' switches to; set"
                        " train.guard=backoff, or leave train.guard_view empty.")
      _views("train.guard_view", self.guard_view, sep="\0")
      from opdjax.views.view import EngineView

      if EngineView.parse(self.guard_view).lag:
        raise UserError(f"train.guard_view={self.guard_view!r} has a lag: a backoff lowers staleness through"
                        " rollout.async_depth; give the guard a view without lag (e.g. 'clean').")


@dataclasses.dataclass(frozen=True)
class MismatchConfig:
  """`opdjax mismatch`: engine views (see opdjax.views.view.EngineView), ';'-separated."""

  sources: str = ";".join([
      "clean", "compute_dtype=bfloat16", "weights=bf16", "weights=fp8", "weights=fp8_e5m2", "weights=int8",
      "kv_quant=fp8_e4m3", "kv_quant=fp8_e5m2", "noise_sigma=0.01", "noise_sigma=0.03", "noise_sigma=0.1",
      "lag=1", "lag=2", "lag=4", "weights=fp8,kv_quant=fp8_e4m3,lag=2,noise_sigma=0.01"])
  warmup_steps: int = 8
  num_prompts: int = 128
  seed: int = 0

  def check(self):
    _views("mismatch.sources", self.sources)


@dataclasses.dataclass(frozen=True)
class SensitivityConfig:
  """`opdjax sensitivity`: quantize/noise one layer and one module kind of `model` at a time; rank by
  exact KL on the same tokens; build the recipe keeping the fewest most-sensitive layers in bf16 under
  `target_kl` (0: half of the all-quantized recipe's KL above the clean floor)."""

  model: str = "teacher"
  formats: str = "fp8_e4m3,fp8_e5m2,int8"
  noise_sigma: float = 0.05
  recipe_format: str = "fp8_e4m3:channel"
  target_kl: float = 0.0
  num_prompts: int = 64
  seed: int = 0

  def check(self):
    from opdjax.models.quant import QuantFormat

    _choice("sensitivity.model", self.model, ("teacher", "student"))
    for f in [*self.formats.split(","), self.recipe_format]:
      try:
        QuantFormat.parse(f.strip())
      except UserError as e:
        raise UserError(f"sensitivity: {e}") from None


@dataclasses.dataclass(frozen=True)
class PrefixShiftConfig:
  """`opdjax prefix-shift`: clean vs perturbed engines on the same prompts and RNG stream."""

  views: str = ";".join(["noise_sigma=0.01", "noise_sigma=0.03", "noise_sigma=0.1", "noise_sigma=0.3",
                         "weights=fp8", "weights=fp8_e5m2", "lag=1", "lag=4", "lag=16"])
  warmup_steps: int = 16
  num_prompts: int = 128
  seed: int = 0

  def check(self):
    _views("prefix_shift.views", self.views)


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
  """`opdjax calibrate`: short OPD runs (the loop `opdjax train` runs) at each engine view, `seeds` seeds
  each (seed, seed + 1, ...); the budget is the largest mismatch whose quality loss vs the clean runs
  stays within the tolerance."""

  views: str = ";".join(["clean", "noise_sigma=0.1", "noise_sigma=0.4", "noise_sigma=0.8", "noise_sigma=1.6",
                         "noise_sigma=3.2", "lag=4", "lag=32"])
  seeds: int = 3
  steps: int = 800
  eval_every: int = 100
  tolerance_sigmas: float = 2.0
  tolerance_rel: float = 0.05
  warmup_steps: int = 32
  num_prompts: int = 128
  seed: int = 0
  force: bool = False  # write a budget even when the clean runs did not learn (it is then marked untrusted)

  def check(self):
    _views("calibrate.views", self.views)
    if self.seeds < 2:
      raise UserError(f"calibrate.seeds={self.seeds}: the tolerance needs the seed variance; use at least 2 seeds.")
    _positive("calibrate.seeds", self.seeds)
    _positive("calibrate.steps", self.steps)


@dataclasses.dataclass(frozen=True)
class AdmitConfig:
  """`opdjax admit`: candidates' mismatch on the calibration batch, bootstrap interval over sequences;
  KV-cache capacity benefit computed for `memory_gib` of device memory."""

  bootstrap: int = 1000
  confidence: float = 0.95
  memory_gib: float = 72.0

  def check(self):
    if self.bootstrap < 10:
      raise UserError(f"admit.bootstrap={self.bootstrap}: use at least 10 resamples (1000 is the default).")
    if not 0 < self.confidence < 1:
      raise UserError(f"admit.confidence={self.confidence}: give a level in (0, 1), e.g. 0.95.")


@dataclasses.dataclass(frozen=True)
class GrpoSection:
  """GRPO baseline (scripts/compare_opd_grpo.py): rollout.batch_size completions per step, in groups of
  group_size per prompt; learning_rate 0 uses optim.learning_rate."""

  group_size: int = 8
  normalize_std: bool = True
  is_correction: str = "none"
  is_threshold: float = 2.0
  learning_rate: float = 0.0

  def check(self):
    _positive("grpo.group_size", self.group_size)
    _choice("grpo.is_correction", self.is_correction, ("none", "tis", "mis"))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh of the trainer and the JAX engine (opdjax.parallel): `data` x `fsdp` x `tensor`
  devices, -1 = the rest of the devices (at most one axis). Batch rows go over (data, fsdp); params,
  optimizer state and the teacher are sharded over fsdp, attention heads and the MLP hidden over
  tensor. All 1: one device, nothing sharded. Whether the sizes divide the devices, heads and batch
  is checked where the devices are known (opdjax.parallel.mesh)."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  def check(self):
    sizes = {"mesh.data": self.data, "mesh.fsdp": self.fsdp, "mesh.tensor": self.tensor}
    for k, v in sizes.items():
      if v == 0 or v < -1:
        raise UserError(f"{k}={v}: give a positive axis size, or -1 for the rest of the devices.")
    rest = [k for k, v in sizes.items() if v == -1]
    if len(rest) > 1:
      raise UserError(f"{' and '.join(rest)} are both -1: at most one mesh axis takes the rest of the devices.")


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = 0
  task: TaskConfig = TaskConfig()
  model: ModelConfig = ModelConfig()
  teacher: TeacherConfig = TeacherConfig()
  student: StudentConfig = StudentConfig()
  rollout: RolloutConfig = RolloutConfig()
  loss: LossConfig = LossConfig(topk=8, chunk=64)
  optim: OptimConfig = OptimConfig(learning_rate=5e-3, total_steps=800)
  train: TrainConfig = TrainConfig()
  mismatch: MismatchConfig = MismatchConfig()
  sensitivity: SensitivityConfig = SensitivityConfig()
  prefix_shift: PrefixShiftConfig = PrefixShiftConfig()
  calibrate: CalibrateConfig = CalibrateConfig()
  admit: AdmitConfig = AdmitConfig()
  grpo: GrpoSection = GrpoSection()
  mesh: MeshConfig = MeshConfig()

  def check(self) -> Config:
    for f in dataclasses.fields(self):
      section = getattr(self, f.name)
      if hasattr(section, "check"):
        section.check()
    if self.train.guard_view and self.rollout.engine == "vllm":
      try:
        RolloutConfig(engine="vllm", view=self.train.guard_view).check()
      except UserError as e:
        raise UserError(f"train.guard_view: {e}") from None
    if self.task.name == "prompts" and not self.teacher.path:
      raise UserError("task.name='prompts' needs teacher.path: an HF folder whose tokenizer encodes the prompts.")
    if self.rollout.async_depth and (self.mesh.data, self.mesh.fsdp, self.mesh.tensor) != (1, 1, 1):
      raise UserError(f"rollout.async_depth={self.rollout.async_depth} with a sharded mesh: the asynchronous producer"
                      " samples on a device of its own; use rollout.async_depth=0, or the default mesh (all 1).")
    return self

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **sections) -> Config:
    """`cfg.replace(train={"steps": 3})`: a copy with some keys of some sections changed, checked."""
    kw = {}
    for name, changes in sections.items():
      cur = getattr(self, name)
      kw[name] = dataclasses.replace(cur, **changes) if isinstance(changes, dict) else changes
    return dataclasses.replace(self, **kw).check()


def _build(cls, values: dict, where: str):
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ConfigError(f"unknown config key {where}{unknown[0]}; valid keys in {where.rstrip('.') or '<root>'}:"
                      f" {sorted(names)}")
  kw = {}
  for name, value in values.items():
    t = hints[name]
    if dataclasses.is_dataclass(t):
      kw[name] = _build(t, dict(value), f"{where}{name}.")
    else:
      kw[name] = _coerce(f"{where}{name}", value, t)
  try:
    return cls(**kw)
  except UserError as e:  # a section's own validation (LossConfig, OptimConfig)
    raise ConfigError(str(e)) from None


def _coerce(key: str, value: Any, t):
  if t is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if t in (int, float, str, bool) and not isinstance(value, t) or (t is int and isinstance(value, bool)):
    raise ConfigError(f"{key}={value!r}: expected {t.__name__}.")
  return value


def build(cfg: ml_collections.ConfigDict | dict) -> Config:
  """The typed, validated config from a ConfigDict (or its `to_dict()`)."""
  values = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else dict(cfg)
  try:
    return _build(Config, values, "").check()
  except UserError as e:
    raise ConfigError(str(e)) from None


def flat(d: dict, prefix: str = "") -> dict[str, Any]:
  """{'train': {'steps': 3}} -> {'train.steps': 3}."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out
