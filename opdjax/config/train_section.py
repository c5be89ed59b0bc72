"""The `train` section of the config: the loop's length, checkpoints, loggers, guards and gradient accumulation
(opdjax.config.schema assembles it with the other sections)."""

from __future__ import annotations

import dataclasses
import os

from opdjax.config.sections import CHECK_PATHS, check_choice, check_positive, check_views
from opdjax.errors import UserError

NONFINITE = ("halt", "skip")
BEST_METRICS = ("", "reverse_kl", "accuracy")
GUARDS = ("warn", "backoff", "halt")

LOGGERS = ("jsonl", "tensorboard", "wandb", "trackio")
# Keys this opdjax no longer has, each with what replaced it: set, they are refused naming it; in an older
# run's config they are left out of a resume's comparison.
GONE = {"train.tensorboard": "TensorBoard is a logger now: train.loggers=jsonl,tensorboard"}


def gone(key: str) -> str | None:
  """The one-line refusal of a key that is gone, None for any other key."""
  return f"{key} is gone: {GONE[key]}." if key in GONE else None


def parse_loggers(spec: str) -> tuple[str, ...]:
  """`train.loggers` ('jsonl,wandb') as names, each checked."""
  names = tuple(dict.fromkeys(x.strip() for x in spec.split(",") if x.strip()))
  for name in names:
    if name not in LOGGERS:
      raise UserError(f"train.loggers={spec!r}: {name!r} is not a logger; choose from {', '.join(LOGGERS)}"
                      " (comma-separated, e.g. 'jsonl,wandb').")
  return names


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Checkpoints (Orbax) go to OUT/checkpoints every `checkpoint_every` steps and at the end; the same
  --out resumes from the latest. on_nonfinite: halt (keep the last good checkpoint) or skip.
  budget: a budget.json of `opdjax calibrate`; `guard` compares the mean of the last `guard_window`
  steps' mismatch with it: warn, backoff (lower rollout.async_depth, then switch to `guard_view`)
  or halt (opdjax.pipeline.guards). `timed`: every step's record carries the time split (time_generate_s,
  time_train_s, ...; a synchronous run then waits for each stage, asynchronous runs always carry it).
  loggers: every writer of the records, comma-separated from jsonl (OUT/metrics.jsonl, always written),
  tensorboard (OUT/tensorboard/), wandb, trackio (opdjax.pipeline.writers; `tracker_project` names the W&B /
  trackio project). log_samples_every: every k steps a few samples to OUT/samples.jsonl and the trackers' tables
  (0: none). length_guard: off, warn or halt when more than `length_guard_threshold` of the completions
  hit rollout.max_new_tokens over `length_guard_window` steps (opdjax.pipeline.guards). collapse_guard:
  off, warn or halt when the completions' entropy and distinct-token share over `collapse_guard_window` steps
  both fall under `collapse_guard_ratio` x those of the run's first window. micro_batches:
  gradient accumulation (opdjax.training.step.accumulate_gradients)."""

  steps: int = 1200
  micro_batches: int = 1
  eval_every: int = 1
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  best_metric: str = "reverse_kl"
  on_nonfinite: str = "halt"
  budget: str = ""
  guard: str = "warn"
  guard_view: str = ""
  guard_window: int = 5
  timed: bool = False
  loggers: str = "jsonl"
  tracker_project: str = "opdjax"
  log_samples_every: int = 0
  length_guard: str = "warn"
  length_guard_threshold: float = 0.5
  length_guard_window: int = 5
  collapse_guard: str = "warn"
  collapse_guard_ratio: float = 0.5
  collapse_guard_window: int = 5

  def check(self):
    check_positive("train.steps", self.steps)
    check_positive("train.micro_batches", self.micro_batches)
    parse_loggers(self.loggers)
    check_positive("train.log_samples_every", self.log_samples_every, 0)
    if self.log_samples_every > self.steps:
      raise UserError(f"train.log_samples_every={self.log_samples_every} is larger than the run (train.steps="
                      f"{self.steps}): no sample would be logged; give at most {self.steps}, or 0 for none.")
    check_choice("train.length_guard", self.length_guard, ("off", "warn", "halt"))
    if not 0.0 <= self.length_guard_threshold <= 1.0:
      raise UserError(f"train.length_guard_threshold={self.length_guard_threshold}: a share of completions in [0, 1]"
                      " (e.g. 0.5).")
    check_positive("train.length_guard_window", self.length_guard_window)
    check_choice("train.collapse_guard", self.collapse_guard, ("off", "warn", "halt"))
    if not 0.0 < self.collapse_guard_ratio < 1.0:
      raise UserError(f"train.collapse_guard_ratio={self.collapse_guard_ratio}: a fraction of the first window's"
                      " entropy and distinct-token share in (0, 1) (e.g. 0.5).")
    check_positive("train.collapse_guard_window", self.collapse_guard_window)
    check_positive("train.eval_every", self.eval_every)
    check_positive("train.checkpoint_every", self.checkpoint_every, 0)
    check_positive("train.keep_checkpoints", self.keep_checkpoints)
    check_choice("train.best_metric", self.best_metric, BEST_METRICS)
    check_choice("train.on_nonfinite", self.on_nonfinite, NONFINITE)
    check_choice("train.guard", self.guard, GUARDS)
    check_positive("train.guard_window", self.guard_window)
    if self.budget and CHECK_PATHS.get() and not os.path.isfile(self.budget):
      raise UserError(f"train.budget={self.budget!r} does not exist; write one with `opdjax calibrate --out DIR`"
                      " (DIR/budget.json), or leave train.budget empty.")
    if self.guard != "warn" and not self.budget:
      raise UserError(f"train.guard={self.guard!r} needs train.budget=PATH (a budget.json of `opdjax calibrate`).")
    if self.guard_view:
      if self.guard != "backoff":
        raise UserError(f"train.guard_view={self.guard_view!r} is the view train.guard='backoff' switches to; set"
                        " train.guard=backoff, or leave train.guard_view empty.")
      check_views("train.guard_view", self.guard_view, sep="\0")
      from opdjax.views.view import EngineView

      if EngineView.parse(self.guard_view).lag:
        raise UserError(f"train.guard_view={self.guard_view!r} has a lag: a backoff lowers staleness through"
                        " rollout.async_depth; give the guard a view without lag (e.g. 'clean').")
