"""The run's guards: hooks that read each step's record over a window of steps and act when the window is
over a line (warn, back off, halt). Every guard is a `WindowGuard`: the window of the last
`train.*_window` steps' values (kept in checkpoints: `state()`, so a resumed run acts where the
uninterrupted one would), at most one event a window, recorded as `<name>_event` (metrics.jsonl and a
progress line), and `halt` stopping after the step, checkpointed, with one message naming the step.

- The mismatch guard (`train.guard`, needs `train.budget`): the step's `mismatch_kl_k3_tok` against a
  budget.json of `opdjax calibrate` (the budget file is read and written here too).
- The length guard (`train.length_guard`): the share of completions that hit rollout.max_new_tokens.
- The collapse guard (`train.collapse_guard`): entropy and the distinct-token share against the run's first
  window.

A guard edits the record it reads (its window mean, its event), so it runs before the writers
(opdjax.pipeline.hooks.assemble keeps that order).

Budget units. A budget.json holds the largest mismatch, as the token mean of the exact KL(engine ||
trainer) on the calibration batch, whose runs kept their quality. The train step logs `mismatch_kl_k3_tok`,
Schulman's k3 estimate of the same KL per token on the step's own rollout: the tokens are sampled from the
engine, so at each position E[e^r - r - 1] (r = log p_trainer - log q_engine) is the exact KL there. Same
metric, same units (nats per token); one step's estimate over a few hundred tokens is noisy, hence the window.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os

import jax
import numpy as np

from opdjax.errors import UserError
from opdjax.pipeline.loop import Hook, Loop
from opdjax.views.view import EngineView

BUDGET_FORMAT = 1
METRIC = "mismatch_kl_k3_tok"
SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # they shape the engine's distribution, hence the KL's scale
COLLAPSE_SIGNALS = ("entropy", "distinct_frac")  # what the collapse guard compares with the run's first window


class GuardHalt(UserError):
  """A guard (or the non-finite policy) stopped the run; `records`: the run's records up to the stop."""

  def __init__(self, message: str, records: list[dict]):
    super().__init__(message)
    self.records = records


class LengthHalt(GuardHalt):
  pass


class CollapseHalt(LengthHalt):
  pass


class WindowGuard(Hook):
  """A window of the last `window` steps' values (`value(rec)`, None: the record has none), judged when full
  (`over(rec)`: a sentence when over the line, else None). After an event the window starts afresh. `warn`
  records the event; with `warn_once` only again after the signal has cleared. `halt` stops the run after the
  step. `act(loop)`: any other policy's action (the mismatch guard's backoff), as the event's tail."""

  name = ""  # the config key (train.<name>) and the record's `<name>_event`; RunState's field
  halt_error = GuardHalt
  warn_once = True
  title = ""  # how the halt message names the guard
  advice = ""  # the halt message's last sentence: what to change, in a new --out

  def __init__(self, policy: str, window: int, checkpointer=None, state: dict | None = None):
    self.policy, self.window, self.ckpt = policy, window, checkpointer
    state = state or {}
    self.values: collections.deque = collections.deque(state.get("values", []), maxlen=window)
    self.armed = state.get("armed", True)
    self.halted: int | None = None

  def state(self) -> dict:
    return {"values": list(self.values), "armed": self.armed}

  def value(self, rec: dict):
    raise NotImplementedError

  def over(self, rec: dict) -> str | None:
    raise NotImplementedError

  def why_halted(self) -> str:
    """What the window held when the guard halted (the halt message's middle)."""
    raise NotImplementedError

  def act(self, loop: Loop) -> str:
    raise NotImplementedError

  def record(self, loop: Loop, rec: dict) -> None:
    v = None if self.halted is not None else self.value(rec)
    if v is None:
      return
    self.values.append(v)
    if len(self.values) < self.window:
      return
    over = self.over(rec)
    if over is None:
      self.armed = True
      return
    self.values.clear()  # the next verdict is on a fresh window: at most one event a window
    if self.policy == "warn" and self.warn_once and not self.armed:
      return
    self.armed = False
    if self.policy == "warn":
      rec[f"{self.name}_event"] = f"{over} (train.{self.name}=warn)"
    elif self.policy == "halt":
      rec[f"{self.name}_event"] = f"{over}: halt"
      self.halted = rec["step"]
      loop.stop = self.name
    else:
      rec[f"{self.name}_event"] = f"{over}: {self.act(loop)}"

  def end(self, loop: Loop) -> None:
    if self.halted is not None:
      where = "" if self.ckpt is None else " " + self.ckpt.settled()
      raise self.halt_error(f"{self.title}: at step {self.halted}, {self.why_halted()}; halted.{where} {self.advice}",
                            list(loop.records))


class MismatchGuard(WindowGuard):
  """The mean of the last `window` steps' `mismatch_kl_k3_tok` against `budget` (see the module doc). Records
  get `guard_mismatch` (the window mean) and `guard_budget` once the window is full. `backoff` lowers
  rollout.async_depth by one (down to synchronous), then switches the rollout view to `safer_view`
  (train.guard_view), and restarts its window; it warns at every window over budget."""

  name, title = "guard", "mismatch guard"
  warn_once = False
  POLICIES = ("warn", "backoff", "halt")

  def __init__(self, budget: float, path: str, policy: str, window: int, safer_view: EngineView | None = None,
               checkpointer=None, state: dict | None = None):
    if policy not in self.POLICIES:
      raise UserError(f"train.guard={policy!r}; choose one of {', '.join(repr(p) for p in self.POLICIES)}.")
    super().__init__(policy, window, checkpointer, state)
    self.budget, self.path, self.safer = budget, path, safer_view
    self.skip = (state or {}).get("skip", 0)
    self.events = (state or {}).get("events", 0)
    self.live = math.nan

  def state(self) -> dict:
    return {"values": list(self.values), "skip": self.skip, "events": self.events}

  def value(self, rec: dict):
    if METRIC not in rec:
      return None
    if self.skip:  # a step sampled before the last backoff took effect
      self.skip -= 1
      return None
    return rec[METRIC]

  def over(self, rec: dict) -> str | None:
    self.live = sum(self.values) / self.window
    rec["guard_mismatch"], rec["guard_budget"] = self.live, self.budget
    if self.live > self.budget:
      self.events += 1
      return f"live mismatch {self.live:.4g} > budget {self.budget:.4g}"
    return None

  def act(self, loop: Loop) -> str:
    sampler = loop.sampler
    if sampler.depth > 0:
      what = f"rollout.async_depth {sampler.depth} -> {sampler.depth - 1}"
      sampler.reconfigure(depth=sampler.depth - 1)
    elif self.safer is not None and sampler.view != self.safer:
      what = f"rollout.view {sampler.view} -> {self.safer}"
      sampler.reconfigure(view=self.safer)
    else:
      return "nothing left to back off (synchronous, on train.guard_view or without one)"
    # The next step was sampled before the change (it is already dispatched): leave it out of the window.
    self.skip = 1
    return f"backoff: {what}"

  advice = ("Lower the mismatch (rollout.view, rollout.async_depth), or use train.guard=backoff with a"
            " train.guard_view, in a new --out.")

  def why_halted(self) -> str:
    return (f"the live mismatch {self.live:.4g} nats/token (mean of the last {self.window} steps' {METRIC}) exceeds"
            f" the budget {self.budget:.4g} of {self.path}")


class LengthGuard(WindowGuard):
  """Length inflation (completions growing until they hit the cap): the mean `truncated_frac` (rows that used
  all rollout.max_new_tokens without EOS) over the window against `threshold`; `length_guard_truncated` holds
  the window mean. A config whose cap is short by design warns once, not every window."""

  name, title = "length_guard", "length guard"
  halt_error = LengthHalt

  def __init__(self, policy: str, threshold: float, window: int, checkpointer=None, state: dict | None = None):
    super().__init__(policy, window, checkpointer, state)
    self.threshold, self.share = threshold, 0.0

  def value(self, rec: dict):
    return rec.get("truncated_frac")

  def over(self, rec: dict) -> str | None:
    self.share = rec["length_guard_truncated"] = sum(self.values) / self.window
    if self.share <= self.threshold:
      return None
    return (f"{self.share:.0%} of completions hit rollout.max_new_tokens over the last {self.window} steps (threshold"
            f" {self.threshold:.0%})")

  advice = ("The student's completions are growing to the cap (length inflation): look at samples.jsonl, raise"
            " rollout.max_new_tokens, or lower the learning rate, in a new --out.")

  def why_halted(self) -> str:
    return (f"{self.share:.0%} of the last {self.window} steps' completions hit rollout.max_new_tokens without EOS"
            f" (train.length_guard_threshold={self.threshold})")


class CollapseGuard(WindowGuard):
  """Collapse (every completion the same few tokens: 24 spaces, newlines, one digit repeated): the mean
  `entropy` (the sampled tokens' per-token entropy) and `distinct_frac` (Rollout.lengths) over the window
  against the same means over the run's first window (the reference, kept in checkpoints). Collapse is both
  under `ratio` x their references: a student that only grows sharper (entropy falling toward the teacher's)
  keeps writing varied tokens. `repeat_ngram_frac` is recorded beside them (`collapse_guard_*` fields of the
  window's last record) for the reader."""

  name, title = "collapse_guard", "collapse guard"
  halt_error = CollapseHalt

  def __init__(self, policy: str, ratio: float, window: int, checkpointer=None, state: dict | None = None):
    super().__init__(policy, window, checkpointer, state)
    self.ratio = ratio
    self.reference: list[float] | None = (state or {}).get("reference")
    self.said = ""

  def state(self) -> dict:
    return {**super().state(), "reference": self.reference}

  def value(self, rec: dict):
    if not all(k in rec for k in COLLAPSE_SIGNALS):
      return None
    return [float(rec[k]) for k in COLLAPSE_SIGNALS] + [float(rec.get("repeat_ngram_frac", 0.0))]

  def over(self, rec: dict) -> str | None:
    now = np.mean(np.asarray(list(self.values)), axis=0).tolist()
    if self.reference is None:  # the run's first window: the reference, nothing to compare yet
      self.reference = now
      return None
    for k, a in zip(COLLAPSE_SIGNALS + ("repeat_ngram_frac",), now):
      rec[f"collapse_guard_{k}"] = a
    if not all(a < self.ratio * b for a, b in zip(now[:2], self.reference[:2])):
      return None
    low = " and ".join(f"{k} {a:.3g} (first {self.window} steps: {b:.3g})"
                       for k, a, b in zip(COLLAPSE_SIGNALS, now, self.reference))
    self.said = (f"{low} fell under {self.ratio:g}x over the last {self.window} steps; longest repeated n-gram"
                 f" {now[2]:.0%} of a completion")
    return f"collapse: {self.said}"

  advice = ("The student is collapsing onto a few tokens: look at samples.jsonl beside the teacher's completions,"
            " lower optim.learning_rate or keep more of the teacher's layers, in a new --out.")

  def why_halted(self) -> str:
    return f"{self.said} (train.collapse_guard_ratio={self.ratio})"


def run_guards(cfg, checkpointer, budget: float | None, states: dict | None = None) -> list[WindowGuard]:
  """The guards `cfg.train` asks for, with the states a checkpoint kept ({name: state()}; a fresh run: none)."""
  t, states = cfg.train, states or {}
  guards: list[WindowGuard] = []
  if budget is not None:
    guards.append(MismatchGuard(budget, t.budget, t.guard, t.guard_window,
                                EngineView.parse(t.guard_view) if t.guard_view else None, checkpointer,
                                states.get("guard")))
  if t.length_guard != "off":
    guards.append(LengthGuard(t.length_guard, t.length_guard_threshold, t.length_guard_window, checkpointer,
                              states.get("length_guard")))
  if t.collapse_guard != "off":
    guards.append(CollapseGuard(t.collapse_guard, t.collapse_guard_ratio, t.collapse_guard_window, checkpointer,
                                states.get("collapse_guard")))
  return guards


# The budget file (budget.json): `opdjax calibrate` writes it (opdjax.analyses.admission), `opdjax admit` and
# the mismatch guard read it; the fingerprint ties a budget to the student it was calibrated on.

def params_fingerprint(params) -> str:
  h = hashlib.sha256()
  for x in jax.tree.leaves(params):
    h.update(np.asarray(x, np.float32).tobytes())
  return h.hexdigest()[:16]


def load_budget(path: str) -> dict:
  if not os.path.exists(path):
    raise UserError(f"budget file {path} does not exist; write one with `opdjax calibrate --out DIR`.")
  try:
    with open(path) as f:
      budget = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON ({e}); re-run `opdjax calibrate`.") from None
  if budget.get("format") != BUDGET_FORMAT or "budget" not in budget:
    raise UserError(f"{path} is not a budget.json of this opdjax (format {BUDGET_FORMAT}); re-run `opdjax calibrate`.")
  return budget


def load_run_budget(path: str, session) -> float:
  """The budget (exact KL per token) of `path`, refused when it does not fit this run: missing, malformed,
  calibrated on another student or with other sampling settings."""
  budget = load_budget(path)  # missing, not JSON, or not a budget.json of this opdjax: one error each
  value = budget["budget"]
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
    raise UserError(f"train.budget={path}: 'budget' is {value!r}, not a KL >= 0; re-run `opdjax calibrate`.")
  # host_tree: the student whole on every host (a collective with several processes: each reads the budget)
  student = session.placement.host_tree(session.student_params)
  theirs, ours = budget.get("student_fingerprint"), params_fingerprint(student)
  if theirs != ours:
    raise UserError(f"train.budget={path} was calibrated on another student (fingerprint {theirs}; this run's"
                    f" student is {ours}); calibrate a budget for this student (`opdjax calibrate` with this"
                    " config), or drop train.budget.")
  rollout = (budget.get("config") or {}).get("rollout", {})
  for key in SAMPLING_KEYS:
    if key in rollout and rollout[key] != getattr(session.cfg.rollout, key):
      raise UserError(f"train.budget={path} was calibrated with rollout.{key}={rollout[key]!r}, this run samples"
                      f" with {getattr(session.cfg.rollout, key)!r}: the KL's scale differs. Calibrate with this"
                      " run's sampling settings.")
  return float(value)
