"""The runtime mismatch guard: each step's live mismatch against a calibrated budget.

`train.budget=PATH` is a budget.json from `opdjax calibrate`: the largest mismatch, as the token
mean of the exact KL(engine || trainer) on the calibration batch, whose runs kept their quality.
The train step logs `mismatch_kl_k3_tok`, Schulman's k3 estimate of the same KL(engine || trainer)
per token on the step's own rollout: the tokens are sampled from the engine, so at each position
E[e^r - r - 1] (r = log p_trainer - log q_engine) is the exact KL there, and the token mean
estimates the token mean of the exact KL. Same metric, same units (nats per token); the batch is
the step's instead of the calibration batch. One step's estimate over a few hundred tokens is
noisy, so the guard compares the mean over the last `train.guard_window` steps.

`train.guard`: `warn` records an event (metrics.jsonl `guard_event`, a progress line); `backoff`
lowers rollout.async_depth by one (down to synchronous), then switches the rollout view to
`train.guard_view`, and restarts its window; `halt` stops after the step with a checkpoint of it
and a message naming the step, the value and the budget.
"""

from __future__ import annotations

import collections
import math

from opdjax.errors import UserError
from opdjax.pipeline.budget import load_budget, params_fingerprint
from opdjax.pipeline.loop import Hook, Loop
from opdjax.views.view import EngineView

POLICIES = ("warn", "backoff", "halt")
METRIC = "mismatch_kl_k3_tok"
SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # they shape the engine's distribution, hence the KL's scale


class GuardHalt(UserError):
  def __init__(self, message: str, records: list[dict]):
    super().__init__(message)
    self.records = records


def load_run_budget(path: str, session) -> float:
  """The budget (exact KL per token) of `path`, refused when it does not fit this run: missing,
  malformed, calibrated on another student or with other sampling settings."""

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


class GuardHook(Hook):
  """Compares the mean of the last `window` steps' `mismatch_kl_k3_tok` with `budget` (see the module doc).
  Records get `guard_mismatch` (the window mean, once the window is full) and, when it acts,
  `guard_event`. Put it before the writers: it annotates the record they write."""

  def __init__(self, budget: float, path: str, policy: str, window: int, safer_view: EngineView | None = None,
               checkpointer=None, state: dict | None = None):
    if policy not in POLICIES:
      raise UserError(f"train.guard={policy!r}; choose one of {', '.join(repr(p) for p in POLICIES)}.")
    self.budget, self.path, self.policy, self.window = budget, path, policy, window
    self.safer, self.ckpt = safer_view, checkpointer
    state = state or {}
    self.values = collections.deque(state.get("values", []), maxlen=window)
    self.skip = state.get("skip", 0)
    self.events = state.get("events", 0)
    self.halted: tuple[int, float] | None = None

  def state(self) -> dict:
    """What a checkpoint keeps, so a resumed run's guard acts where the uninterrupted one would."""
    return {"values": list(self.values), "skip": self.skip, "events": self.events}

  def record(self, loop: Loop, rec: dict) -> None:
    if METRIC not in rec or self.halted is not None:
      return
    if self.skip:  # a step sampled before the last backoff took effect
      self.skip -= 1
      return
    self.values.append(rec[METRIC])
    if len(self.values) < self.window:
      return
    live = sum(self.values) / self.window
    rec["guard_mismatch"] = live
    rec["guard_budget"] = self.budget
    if not live > self.budget:  # a NaN mismatch is over budget too
      return
    self.events += 1
    self.values.clear()  # the next verdict is on a fresh window: at most one event every `window` steps
    over = f"live mismatch {live:.4g} > budget {self.budget:.4g}"
    if self.policy == "warn":
      rec["guard_event"] = f"{over} (train.guard=warn)"
    elif self.policy == "halt":
      rec["guard_event"] = f"{over}: halt"
      self.halted = (rec["step"], live)
      loop.stop = "guard"
    else:
      rec["guard_event"] = f"{over}: {self._backoff(loop)}"

  def _backoff(self, loop: Loop) -> str:
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

  def end(self, loop: Loop) -> None:
    if self.halted is None:
      return
    step, live = self.halted
    where = "" if self.ckpt is None else " " + self.ckpt.settled()
    raise GuardHalt(f"mismatch guard: at step {step} the live mismatch {live:.4g} nats/token (mean of the last"
                    f" {self.window} steps' {METRIC}) exceeds the budget {self.budget:.4g} of {self.path}; halted."
                    f"{where} Lower the mismatch (rollout.view, rollout.async_depth), or use train.guard=backoff"
                    " with a train.guard_view, in a new --out.", list(loop.records))
