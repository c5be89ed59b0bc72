"""The content of an OPD checkpoint (`RunState`): the one description of the checkpoint format.

A checkpoint at step s holds everything the run needs to continue as if never stopped: the
`TrainState` (student params, optimizer state, step), the buffer of past params versions that
lagged rollouts sample from, and JSON metadata (the config, the student's HF config, the engine
settings the sampler ran with, the mismatch guard's state, the latest held-out evaluation, package
versions). The checkpoint hook saves one, resume and export restore one (opdjax.pipeline.checkpoint
writes and reads it, with each array's content checksum). Everything random in the loop is derived from
(seed, step), so no RNG state needs saving.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

from opdjax.errors import UserError
from opdjax.views.view import EngineView

# The train state's tree, as a checkpoint's metadata records it. 2: the learning-rate schedule's hyperparameters are
# arrays in the optimizer state (opdjax.training.step.ScheduleState); 1 (no key): the schedule's count alone.
STATE_LAYOUT = 2


class CheckpointOfAnotherLayout(UserError):
  """The checkpoint's train state has another tree than this opdjax writes: a refusal before any array is read,
  not a damaged checkpoint (nothing is moved)."""


def check_layout(meta: dict, step: int, directory: str) -> None:
  got = meta.get("state_layout", 1)
  if got != STATE_LAYOUT:
    raise CheckpointOfAnotherLayout(
        f"checkpoint step {step} in {directory} holds a train state of layout {got}, written by another opdjax"
        f" version; this one reads layout {STATE_LAYOUT} (the learning-rate schedule inside the optimizer state)."
        " Export its student with the opdjax that wrote it (`opdjax export`), or train into a new --out folder."
        " Nothing was moved or overwritten.")


def package_versions() -> dict[str, str]:
  out = {}
  for name in ("opdjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out



@dataclasses.dataclass
class RunState:
  """A whole OPD run at a checkpointed step: the tree Orbax stores (`train`, `history`) and the JSON
  metadata beside it. The one description of the checkpoint format; `RunCheckpointer.save_run` and
  `restore_run` write and read both halves together."""

  step: int
  train: Any  # TrainState: student params, optimizer state, step
  history_versions: list[int]  # the params versions a lagged view samples from, oldest first ...
  history: list  # ... and their params
  last_eval: dict | None  # the latest held-out evaluation (with its eval_step)
  config: dict  # Config.to_dict() of the run
  student_config: dict  # the student's HF config: a resume refuses another model
  kind: str  # the deployment (opdjax.rollout.deploy: jax, vllm, ...)
  view: EngineView  # the rollout view and asynchronous depth the sampler ran with at this step:
  depth: int  # the config's, or where the mismatch guard's backoffs took them
  async_mode: str
  sampling: dict  # SamplingParams fields
  teacher_view: str
  guard: dict | None = None  # MismatchGuard.state() of a run with train.budget (opdjax.pipeline.guards)
  length_guard: dict | None = None  # LengthGuard.state(): its window
  collapse_guard: dict | None = None  # CollapseGuard.state(): its window and reference
  versions: dict = dataclasses.field(default_factory=dict)  # package versions that wrote it

  @classmethod
  def of(cls, loop, step: int, guard: dict | None = None, length_guard: dict | None = None,
         collapse_guard: dict | None = None) -> RunState:
    """What a checkpoint of `loop` at `step` holds (`guard`, `length_guard`: the mismatch and length guards'
    states, where the run has them)."""
    session, sampler = loop.session, loop.sampler
    h = sampler.history
    return cls(step=step, train=loop.state, history_versions=h.versions if h else [], history=h.params() if h else [],
               last_eval=loop.last_eval, config=session.cfg.to_dict(), student_config=session.student.cfg.to_hf_dict(),
               kind=session.deployment.kind, view=sampler.view, depth=sampler.depth,
               async_mode=session.cfg.rollout.async_mode, sampling=dataclasses.asdict(session.sampling),
               teacher_view=str(session.teacher_view), guard=guard, length_guard=length_guard,
               collapse_guard=collapse_guard,
               versions=package_versions())

  def tree(self) -> dict:
    return {"train": self.train, "history": self.history}

  def meta(self) -> dict:
    out = {"step": self.step, "last_eval": self.last_eval, "config": self.config, "student_config": self.student_config,
           "history_versions": self.history_versions,
           "engine": {"kind": self.kind, "view": str(self.view), "view_fields": dataclasses.asdict(self.view),
                      "async_depth": self.depth, "async_mode": self.async_mode, "sampling": self.sampling},
           "teacher_view": self.teacher_view, "params_version": self.step, "versions": self.versions,
           "state_layout": STATE_LAYOUT}
    if self.guard is not None:
      out["guard"] = self.guard
    if self.length_guard is not None:
      out["length_guard"] = self.length_guard
    if self.collapse_guard is not None:
      out["collapse_guard"] = self.collapse_guard
    return out

  @staticmethod
  def target(meta: dict, train) -> dict:
    """The tree to restore a checkpoint with metadata `meta` into: `train`'s structure, shapes and
    shardings, for the train state and for each params version of the history."""
    return {"train": train, "history": [train.params] * len(meta["history_versions"])}

  @classmethod
  def from_checkpoint(cls, tree: dict, meta: dict) -> RunState:
    engine = meta["engine"]
    view = EngineView(**engine["view_fields"]) if "view_fields" in engine else EngineView.parse(engine["view"])
    return cls(step=meta["step"], train=tree["train"], history_versions=list(meta["history_versions"]),
               history=list(tree["history"]), last_eval=meta["last_eval"], config=meta["config"],
               student_config=meta["student_config"], kind=engine.get("kind", ""), view=view,
               depth=engine["async_depth"], async_mode=engine.get("async_mode", "exact"), sampling=engine["sampling"],
               teacher_view=meta.get("teacher_view", "clean"), guard=meta.get("guard"),
               length_guard=meta.get("length_guard"), collapse_guard=meta.get("collapse_guard"),
               versions=meta.get("versions", {}))


