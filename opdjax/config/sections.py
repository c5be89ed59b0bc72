"""The training run's config sections, one frozen dataclass each (task, model, student, teacher,
rollout and its vLLM server, train, mesh), and the checks every section shares. `opdjax.config.schema`
assembles them (with the analyses' sections, `opdjax.config.analysis_sections`) into `Config` and
builds it from a ConfigDict.

Every error names the key and the valid choices.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os

from opdjax.config.server_section import VllmConfig, check_positive  # noqa: F401  (re-exported)
from opdjax.errors import UserError
from opdjax.models.decoder import REMAT_POLICIES
from opdjax.rollout.base import SamplingParams
from opdjax.tasks.addition import ANSWERS

# Files named by the config (task.path, train.budget) are checked to exist, except while a command
# prints commands for another machine (`opdjax launch sidecar`, the launchers' --dry-run), where the
# paths are the cluster's (opdjax.config.resolve.paths_unchecked).
CHECK_PATHS: contextvars.ContextVar[bool] = contextvars.ContextVar("opdjax_check_paths", default=True)

ENGINES = ("jax", "vllm")
DTYPES = ("float32", "bfloat16")
TASKS = ("addition", "prompts")
ASYNC_MODES = ("exact", "bounded")
TEACHER_SCORING = ("trainer", "engine")
TEACHER_SERVE = ("trainer", "vllm")


def check_choice(key: str, value, choices) -> None:
  if value not in choices:
    raise UserError(f"{key}={value!r}; choose one of {', '.join(repr(c) for c in choices)}.")


def check_views(key: str, spec: str, sep: str = ";") -> None:
  from opdjax.views.view import EngineView

  for item in spec.split(sep):
    try:
      EngineView.parse(item)
    except UserError as e:
      raise UserError(f"{key}: {e}") from None


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """`addition` (built-in, exact verifier) or `prompts`: `path`, a JSONL of prompts (or builtin:NAME), or
  `dataset`, a `datasets` dataset (a Hub name, a save_to_disk folder, a local parquet/JSON/CSV/arrow file or
  folder; opdjax.tasks.dataset) whose `split` gives the prompts: the text column `prompt_field`, or the
  chat-messages column `messages_field` (rendered with the student's chat template), `tag_field` a column
  routing prompts to teachers (teacher.routes); held out: `eval_split`'s first num_eval rows, or num_eval
  rows of `split` held back by a fixed permutation.
  `answer` (addition): `sum`, the reversed sum; `worked`, the column sums first (~3x longer answers:
  give rollout.max_new_tokens >= 5 * max_digits + 3; configs/demo_worked.py).
  `long_prompts` (dataset): a prompt longer than rollout.max_len allows is `refuse`d (the default: one line naming
  the longest) or `drop`ped with a count line."""

  name: str = "addition"
  max_digits: int = 2
  answer: str = "sum"
  num_eval: int = 256
  path: str = ""
  chat_template: bool = False
  dataset: str = ""
  split: str = "train"
  eval_split: str = ""
  prompt_field: str = "prompt"
  messages_field: str = ""
  tag_field: str = ""
  long_prompts: str = "refuse"

  def check(self):
    check_choice("task.name", self.name, TASKS)
    check_choice("task.long_prompts", self.long_prompts, ("refuse", "drop"))
    check_positive("task.num_eval", self.num_eval)
    check_choice("task.answer", self.answer, ANSWERS)
    if self.dataset and self.name != "prompts":
      raise UserError(f"task.dataset={self.dataset!r} gives prompts: set task.name='prompts' with it.")
    if self.name == "prompts" and self.dataset:
      if self.path:
        raise UserError(f"task.path={self.path!r} and task.dataset={self.dataset!r} both give the prompts; keep one.")
      if not (self.prompt_field or self.messages_field):
        raise UserError("task.dataset needs a column: task.prompt_field (text) or task.messages_field (chat).")
      if self.eval_split and self.eval_split == self.split:
        raise UserError(f"task.eval_split={self.eval_split!r} is the training split; give another split, or leave it"
                        " empty to hold back task.num_eval rows of task.split.")
    elif self.name == "prompts":
      if not self.path:
        raise UserError("task.path is empty: task.name='prompts' needs a JSONL of prompts (or builtin:NAME), or a"
                        " task.dataset.")
      if not self.path.startswith("builtin:") and CHECK_PATHS.get() and not os.path.exists(self.path):
        raise UserError(f"task.path={self.path!r} does not exist; give a JSONL file of prompts.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Compute dtype of both models' matmuls (params stay fp32; logits and KL are always fp32) and the
  rematerialisation policy of the scanned layers."""

  dtype: str = "float32"
  remat_policy: str = "nothing"

  def check(self):
    check_choice("model.dtype", self.dtype, DTYPES)
    check_choice("model.remat_policy", self.remat_policy, REMAT_POLICIES)


def _check_path(role: str, path: str) -> None:
  from opdjax.models.hub import is_hub_id

  if path and not path.startswith("fetch:") and not is_hub_id(path) and CHECK_PATHS.get() and not os.path.isdir(path):
    raise UserError(f"{role}.path={path!r} is not a folder; give a Hugging Face safetensors folder, a Hub id"
                    " org/name[@revision], or fetch:NAME (see `opdjax models fetch`).")


@dataclasses.dataclass(frozen=True)
class StudentConfig:
  """`path`: an HF folder, a Hub id `org/name[@revision]` (resolved to a snapshot in the HF cache; offline
  from it with HF_HUB_OFFLINE=1: opdjax.models.hub) or `fetch:NAME`; empty builds the demo's model (addition
  task only).
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
  """As the student's, plus `view`: score with a perturbed teacher (e.g. `weights=fp8`), and `serve`:
  where the teacher runs. `trainer` (default): its params and forward pass in the OPD step. `vllm`: its
  own vLLM server(s) score every rollout through prompt log-probs (opdjax.rollout.vllm.teacher), started
  here from `teacher.vllm` (its dtype, its FP8 flags on a GPU; never the rollout's section) or attached
  (`teacher.vllm.url`/`urls`); the trainer then holds no teacher parameters. A served teacher returns
  the sampled token's log-prob and the top-`loss.topk` (`topk_rkl`), so only the objectives that need no
  more than that take it (docs/served_teacher.md)."""

  view: str = "clean"
  hidden_size: int = 64
  sft_steps: int = 1200
  serve: str = "trainer"
  vllm: VllmConfig = VllmConfig()
  check_every: int = 0  # served: every k-th batch re-scored at the trainer's precision (teacher_mismatch_*)
  routes: str = ""  # served, several teachers: 'TAG=FOLDER_OR_URL,...', each prompt's "tag" picks one
  preflight: bool = False  # served: `opdjax admit --teacher` before step 1 (replicas, precision vs train.budget)

  @property
  def route_table(self) -> tuple[tuple[str, str], ...]:
    """`routes` as (tag, target) pairs; a target is an HF folder (its servers started from teacher.vllm's
    settings) or a running server's base URL (attached)."""
    pairs = []
    for item in (x.strip() for x in self.routes.split(",") if x.strip()):
      tag, sep, target = item.partition("=")
      if not sep or not tag.strip() or not target.strip():
        raise UserError(f"teacher.routes={self.routes!r}: {item!r} is not TAG=TARGET; give e.g."
                        " 'math=/models/math-teacher,code=http://127.0.0.1:8001'.")
      pairs.append((tag.strip(), target.strip()))
    tags = [t for t, _ in pairs]
    if len(set(tags)) != len(tags):
      raise UserError(f"teacher.routes={self.routes!r} names a tag twice; give each tag one teacher.")
    return tuple(pairs)

  def check(self, role: str = "teacher"):
    super().check(role)
    check_views("teacher.view", self.view, sep="\0")
    from opdjax.views.view import EngineView

    if EngineView.parse(self.view).lag:
      raise UserError("teacher.view cannot have a lag: the teacher never changes.")
    check_choice("teacher.serve", self.serve, TEACHER_SERVE)
    self.vllm.check("teacher.vllm")
    check_positive("teacher.check_every", self.check_every, 0)
    if self.route_table and self.serve != "vllm":
      raise UserError(f"teacher.routes={self.routes!r} routes prompts to served teachers: set teacher.serve='vllm'.")
    if self.route_table and (self.vllm.attached or self.check_every):
      raise UserError("teacher.routes gives each tag its own teacher (a folder, or a server's URL): leave"
                      " teacher.vllm.url/urls empty and teacher.check_every=0 with it.")
    if self.check_every and self.serve != "vllm":
      raise UserError(f"teacher.check_every={self.check_every} compares a served teacher with the same teacher at the"
                      " trainer's precision; with teacher.serve='trainer' the trainer's teacher is that reference:"
                      " leave teacher.check_every=0.")
    if self.preflight and self.serve != "vllm":
      raise UserError("teacher.preflight admits a served teacher's servers before step 1; with teacher.serve='trainer'"
                      " the trainer's own teacher is the reference: leave teacher.preflight off.")
    if self.serve == "vllm" and EngineView.parse(self.view) != EngineView():
      raise UserError(f"teacher.view={self.view} perturbs the trainer's teacher; a served teacher's precision is its"
                      " server's: set teacher.vllm.dtype / quantization / kv_cache_dtype, and leave teacher.view"
                      " clean.")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """`async_depth` k > 0: a producer samples while the trainer trains, at most k params versions
  behind (opdjax.pipeline.async_sampler); `async_mode` exact (always k behind: equals the `lag=k`
  view bitwise) or bounded (the newest params within k). `devices`: the JAX engine's own devices on
  this host, a count ('2': the last two) or a set of `jax.local_devices()` indices ('2,3'; one: '3,');
  the trainer's mesh is built over the rest (default: the last device that is not the trainer's).
  `teacher_scoring`: where the teacher's layers run on each rollout: `trainer` (in the OPD step) or
  `engine` (the disaggregated JAX engine's process runs them after sampling and returns the teacher's
  final hidden states with the rollout; the step keeps the teacher's output matrix and the fused loss:
  opdjax.rollout.jax.teacher). `engine` moves the teacher's forward pass off the trainer's side, which pays
  where the trainer's side is the longer one (async, docs/async.md); it needs rollout.engine='jax' with
  rollout.placement='disaggregated' and the OPD objective."""

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
  placement: str = "colocated"  # or disaggregated: the engine on cores of its own (opdjax.rollout.deploy)
  teacher_scoring: str = "trainer"

  @property
  def server_gpu_ids(self) -> tuple[str, ...]:
    """The GPUs the rollout's vLLM servers have of their own (`rollout.vllm.gpus`; () for the JAX engine)."""
    return self.vllm.gpu_ids if self.engine == "vllm" else ()

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                          top_k=self.top_k)

  def _check_placement(self) -> None:
    """`rollout.placement` and `rollout.vllm.cpus` (the cores themselves are checked at start-up,
    opdjax.rollout.deploy.core_split, where this process's affinity is known)."""
    from opdjax.rollout.cores import PLACEMENTS, parse_cpus

    check_choice("rollout.placement", self.placement, PLACEMENTS)
    v = self.vllm
    if not v.cpus:
      return
    parse_cpus(v.cpus)
    if self.engine != "vllm":
      raise UserError(f"rollout.vllm.cpus={v.cpus!r} pins the vLLM server; with rollout.engine={self.engine!r} leave it"
                      " empty (a disaggregated JAX engine's process takes the upper half of the cores).")
    if self.placement != "disaggregated":
      raise UserError(f"rollout.vllm.cpus={v.cpus!r} gives the vLLM server cores of its own: set"
                      " rollout.placement=disaggregated, or leave rollout.vllm.cpus empty.")
    if v.attached:
      raise UserError(f"rollout.vllm.cpus={v.cpus!r} pins a server opdjax starts; an attached server (rollout.vllm.url"
                      "/urls) is pinned where it is started (VLLM_CPU_OMP_THREADS_BIND, taskset): leave"
                      " rollout.vllm.cpus empty.")

  def check(self):
    check_choice("rollout.engine", self.engine, ENGINES)
    check_views("rollout.view", self.view, sep="\0")
    check_positive("rollout.batch_size", self.batch_size)
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
    self._check_placement()
    self._check_async()
    check_choice("rollout.teacher_scoring", self.teacher_scoring, TEACHER_SCORING)
    if self.teacher_scoring == "engine" and (self.engine, self.placement) != ("jax", "disaggregated"):
      raise UserError(f"rollout.teacher_scoring='engine' runs the teacher in the JAX engine's own process, which"
                      f" needs rollout.engine='jax' with rollout.placement='disaggregated' (this config:"
                      f" engine={self.engine!r}, placement={self.placement!r}); set both, or leave"
                      " rollout.teacher_scoring='trainer'.")

  def _check_async(self):
    from opdjax.views.view import EngineView

    if self.async_depth < 0:
      raise UserError(f"rollout.async_depth={self.async_depth}: must be >= 0 (0 samples synchronously, k > 0 lets"
                      " the producer run k params versions ahead).")
    check_choice("rollout.async_mode", self.async_mode, ASYNC_MODES)
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
      from opdjax.parallel.devices import parse

      parse(self.devices)


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
