"""The typed config: one frozen dataclass per section, built once from a `configs/*.py` file plus
`--config.a.b=v` overrides and validated there. A ConfigDict never goes past `build()`.

Every error names the key and the valid choices. `Config.to_dict()` is what `config.json`,
checkpoints and budget files record; `build(to_dict(c))` gives `c` back.

The sections' dataclasses live in `opdjax.config.sections` (the training run's) and
`opdjax.config.analysis_sections` (the analyses'); this module assembles them into `Config`, builds
and validates it, and re-exports them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import ml_collections

from opdjax.config.analysis_sections import (
  AdmitConfig,
  CalibrateConfig,
  GrpoSection,
  MismatchConfig,
  PrefixShiftConfig,
  SensitivityConfig,
)
from opdjax.config.loader import ConfigError
from opdjax.config.sections import (  # noqa: F401  (constants re-exported: callers import them from here)
  ASYNC_MODES,
  DTYPES,
  ENGINES,
  TASKS,
  MeshConfig,
  ModelConfig,
  RolloutConfig,
  StudentConfig,
  TaskConfig,
  TeacherConfig,
  VllmConfig,
)
from opdjax.config.train_section import BEST_METRICS, GUARDS, NONFINITE, TrainConfig, gone  # noqa: F401  (re-exported)
from opdjax.errors import UserError
from opdjax.training.loss import FROM_LOGITS, SERVER_ANSWER, SERVER_WHERE, LossConfig, refusal
from opdjax.training.step import OptimConfig

# Where the teacher scores each rollout (Config.teacher_placement) -> what it gives the objective per position
# (opdjax.training.loss) and the placement in words. The teacher seam (opdjax.pipeline.teacher) asks this table;
# nothing else in the package keys on a placement.
TEACHER_PLACEMENTS = {
    "trainer": (FROM_LOGITS, "in the trainer (teacher.serve=trainer)"),
    "engine": (FROM_LOGITS, "on the engine's side (rollout.teacher_scoring=engine)"),  # the trainer applies the head
    "served": (SERVER_ANSWER, SERVER_WHERE),
}


def teacher_placement_of(serve: str, scoring: str = "trainer") -> str:
  """The placement (a TEACHER_PLACEMENTS key) of teacher.serve=`serve` with rollout.teacher_scoring=`scoring`."""
  if serve == "vllm":
    return "served"
  return "engine" if scoring == "engine" else "trainer"


def placement_refusal(placement: str, loss: LossConfig) -> str | None:
  """One line refusing objective `loss` with the teacher at `placement` (opdjax.training.loss.refusal); None
  when that placement feeds it."""
  provides, where = TEACHER_PLACEMENTS[placement]
  return refusal(provides, where, loss)


@dataclasses.dataclass(frozen=True)
class Config:
  seed: int = 0
  task: TaskConfig = TaskConfig()
  model: ModelConfig = ModelConfig()
  teacher: TeacherConfig = TeacherConfig()
  student: StudentConfig = StudentConfig()
  rollout: RolloutConfig = RolloutConfig()
  loss: LossConfig = LossConfig(topk=8, chunk=64)
  optim: OptimConfig = OptimConfig(learning_rate=5e-3, total_steps=0)  # 0: train.steps
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
    self._check_teacher_placement()
    r = self.rollout
    if self.loss.student_logprobs == "rollout" and (r.temperature != 1.0 or 0 < r.top_k or r.top_p < 1.0):
      raise UserError(f"loss.student_logprobs='rollout' takes the student's log-prob at T = 1 from the engine, which"
                      f" samples at rollout.temperature={r.temperature:g}, top_k={r.top_k}, top_p={r.top_p:g}"
                      " (another distribution): set rollout.temperature=1, top_k=0, top_p=1, or"
                      " loss.student_logprobs='trainer'.")
    self._check_micro_batches()
    if self.teacher.preflight and not self.train.budget:
      raise UserError("teacher.preflight compares the served teacher's deviation with the run's mismatch budget: give"
                      " train.budget=PATH (a budget.json of `opdjax calibrate`), or leave teacher.preflight off.")
    if self.task.name == "prompts" and not self.teacher.path:
      raise UserError("task.name='prompts' needs teacher.path: an HF folder whose tokenizer encodes the prompts.")
    return self

  def _check_micro_batches(self) -> None:
    k, rows = self.train.micro_batches, self.rollout.batch_size
    if rows % k:
      raise UserError(f"train.micro_batches={k} does not divide rollout.batch_size={rows}: give a divisor of {rows}.")
    if k > 1 and self.loss.kind == "sampled_rkl" and self.loss.baseline == "loo" and rows // k < 2:
      raise UserError(f"loss.baseline='loo' averages over the other rows of each micro-batch, and train.micro_batches="
                      f"{k} leaves {rows // k} row in each: give train.micro_batches <= {rows // 2}.")

  @property
  def teacher_placement(self) -> str:
    """Where the teacher scores each rollout: 'trainer' (in the OPD step), 'engine' (hidden states from the
    JAX engine's process, rollout.teacher_scoring='engine') or 'served' (its own vLLM servers,
    teacher.serve='vllm'). The one reading of those two keys; everything else asks this (the teacher seam,
    opdjax.pipeline.teacher)."""
    return teacher_placement_of(self.teacher.serve, self.rollout.teacher_scoring)

  @property
  def teacher_served(self) -> bool:
    """The teacher scores each rollout on its own vLLM servers (teacher.serve='vllm')."""
    return self.teacher_placement == "served"

  @property
  def teacher_on_engine(self) -> bool:
    """The JAX engine's process scores the teacher (rollout.teacher_scoring='engine')."""
    return self.teacher_placement == "engine"

  def _check_teacher_placement(self) -> None:
    """The objective against what the teacher's placement gives (TEACHER_PLACEMENTS)."""
    if self.teacher.serve == "vllm" and self.rollout.teacher_scoring != "trainer":
      raise UserError(f"rollout.teacher_scoring={self.rollout.teacher_scoring!r} runs the teacher in the JAX engine's"
                      " process; teacher.serve='vllm' scores it on its own servers: choose one (leave"
                      " rollout.teacher_scoring='trainer').")
    why = placement_refusal(self.teacher_placement, self.loss)
    if why is not None:
      raise UserError(why)

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
  if unknown and gone(f"{where}{unknown[0]}"):
    raise ConfigError(gone(f"{where}{unknown[0]}"))
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
