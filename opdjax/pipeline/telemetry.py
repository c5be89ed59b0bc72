"""What the student writes, step by step: completion lengths, truncation and EOS shares (every record),
a few samples every `train.log_samples_every` steps (OUT/samples.jsonl and the trackers' tables), and the
length guard.

Length inflation (completions growing until they hit the cap) is the failure OPD users report most
after collapse; `truncated_frac` is the share of a step's rows that used all `max_new_tokens` without
ending on EOS. The length guard compares its mean over the last `train.length_guard_window` steps with
`train.length_guard_threshold`: `warn` records `length_guard_event` (and a progress line) when the share
first goes over, and again only after it came back down (a config whose cap is short by design warns
once, not every window); `halt` stops after the step, checkpointed, with one message naming the step and
the share.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from opdjax.errors import UserError
from opdjax.pipeline.loop import Hook, Loop

SAMPLES_PER_LOG = 4  # rows of the step's rollout each samples.jsonl entry shows
HIGHLIGHTS = 5  # tokens per sample with the largest per-token reverse-KL estimate
LENGTH_GUARDS = ("off", "warn", "halt")


class LengthHalt(UserError):
  def __init__(self, message: str, records: list[dict]):
    super().__init__(message)
    self.records = records


class LengthGuardHook(Hook):
  """Mean `truncated_frac` over the last `window` steps against `threshold` (see the module doc). Put it
  before the writers: it annotates the record they write."""

  def __init__(self, policy: str, threshold: float, window: int, checkpointer=None, state: dict | None = None):
    self.policy, self.threshold, self.window, self.ckpt = policy, threshold, window, checkpointer
    state = state or {}
    self.values: collections.deque = collections.deque(state.get("values", []), maxlen=window)
    self.halted: tuple[int, float] | None = None
    self.armed = state.get("armed", True)

  def state(self) -> dict:
    """What a checkpoint keeps, so a resumed run's guard acts where the uninterrupted one would."""
    return {"values": list(self.values), "armed": self.armed}

  def record(self, loop: Loop, rec: dict) -> None:
    if "truncated_frac" not in rec or self.halted is not None:
      return
    self.values.append(rec["truncated_frac"])
    if len(self.values) < self.window:
      return
    share = sum(self.values) / self.window
    rec["length_guard_truncated"] = share
    if share <= self.threshold:
      self.armed = True
      return
    self.values.clear()  # at most one event a window
    if self.policy == "warn" and not self.armed:  # warned already: again once the share has come back down
      return
    self.armed = False
    over = (f"{share:.0%} of completions hit rollout.max_new_tokens over the last {self.window} steps (threshold"
            f" {self.threshold:.0%})")
    rec["length_guard_event"] = over + (": halt" if self.policy == "halt" else " (train.length_guard=warn)")
    if self.policy == "halt":
      self.halted = (rec["step"], share)
      loop.stop = "length_guard"

  def end(self, loop: Loop) -> None:
    if self.halted is None:
      return
    step, share = self.halted
    where = "" if self.ckpt is None else " " + self.ckpt.settled()
    raise LengthHalt(f"length guard: at step {step}, {share:.0%} of the last {self.window} steps' completions hit"
                     f" rollout.max_new_tokens without EOS (train.length_guard_threshold={self.threshold});"
                     f" halted.{where} The student's completions are growing to the cap (length inflation): look at"
                     " samples.jsonl, raise rollout.max_new_tokens, or lower the learning rate, in a new --out.",
                     list(loop.records))


class SamplesHook(Hook):
  """Every `every` steps: the first SAMPLES_PER_LOG rows of the step's rollout (prompt, completion, how
  it ended, the verifier's reward where the task has one, and the HIGHLIGHTS tokens with the largest
  per-token reverse-KL estimate log q(y) - log p_teacher(y), q the distribution the engine sampled from)
  to OUT/samples.jsonl and to every tracker's table."""

  def __init__(self, path: str, every: int, resume_step: int | None, write: bool = True):
    self.path, self.every, self.resume_step, self.file, self.write = path, every, resume_step, None, write
    self._teacher_lp = None

  def start(self, loop: Loop) -> None:
    if not self.write:
      return
    if self.resume_step is not None and os.path.exists(self.path):  # a resumed run logs each step once
      with open(self.path) as f:
        kept = [line for line in f if _step_of(line) is not None and _step_of(line) <= self.resume_step]
      with open(self.path + ".tmp", "w") as f:
        f.writelines(kept)
      os.replace(self.path + ".tmp", self.path)
    self.file = open(self.path, "a")

  def after_step(self, loop: Loop, step: int) -> None:
    if step % self.every or loop.sample is None:
      return
    rows = self.rows(loop, loop.sample, step)
    if not self.write:
      return
    for row in rows:
      self.file.write(json.dumps(row) + "\n")
    self.file.flush()
    flat = [{**{k: v for k, v in r.items() if k != "highlights"},
             "highlights": " ".join(f"{t!r}:{kl:.2f}" for t, kl in r.get("highlights", []))} for r in rows]
    for h in loop.hooks:
      if hasattr(h, "table"):
        h.table(step, flat)

  def rows(self, loop: Loop, sample, step: int) -> list[dict]:
    from opdjax.rollout.base import _host

    session, r = loop.session, sample.rollout
    task = session.task
    decode = task.tokenizer.decode  # every task's tokenizer (HF's, the addition task's characters)
    n = min(SAMPLES_PER_LOG, int(np.asarray(r.completion_mask).shape[0]))
    pt, pm = _host(r.prompt_tokens)[:n], _host(r.prompt_mask)[:n].astype(bool)
    ct, cm = _host(r.completion_tokens)[:n], _host(r.completion_mask)[:n].astype(bool)
    q = _host(r.rollout_logprobs)[:n]
    p = self._teacher_logprobs(session, sample, r, n)
    out = []
    for i in range(n):
      comp = [int(t) for t in ct[i][cm[i]]]
      ended = "eos" if comp and comp[-1] in task.eos_ids else (
          "truncated" if len(comp) >= r.sampling.max_new_tokens else "stopped")
      row = {"step": step, "row": i, "prompt": decode([int(t) for t in pt[i][pm[i]]]),
             "completion": decode(comp), "completion_tokens": len(comp), "ended": ended}
      if getattr(task, "has_verifier", False) and hasattr(task, "is_correct") and sample.refs is not None:
        row["reward"] = float(task.is_correct(sample.refs[i], comp))
      if p is not None:
        kl = (q[i] - p[i])[cm[i]]
        top = np.argsort(-kl)[:HIGHLIGHTS]
        row["reverse_kl_mean"] = float(kl.mean()) if len(kl) else 0.0
        row["highlights"] = [[decode([comp[j]]), round(float(kl[j]), 4)] for j in sorted(top)]
      out.append(row)
    return out

  def _teacher_logprobs(self, session, sample, rollout, n: int):
    """The teacher's log-probs of the first `n` rows' completion tokens `[n, N]`: from a served teacher's
    answer in the batch, else one forward pass of the trainer's teacher (single process only)."""
    import jax

    inputs = sample.inputs[0] if isinstance(sample.inputs, tuple) else sample.inputs
    width = np.asarray(rollout.completion_mask).shape[1]
    if isinstance(inputs, dict) and "teacher_logprobs" in inputs:
      from opdjax.rollout.base import _host

      return np.asarray(_host(inputs["teacher_logprobs"]))[:n, -width:]
    if session.teacher is None or jax.process_count() > 1:
      return None
    from opdjax.scoring.rescore import batch_from_rollout, token_logprobs

    if self._teacher_lp is None:
      self._teacher_lp = jax.jit(lambda params, b: token_logprobs(session.teacher, params, b))
    rows = jax.tree.map(lambda x: np.asarray(jax.device_get(x))[:n], rollout)
    lp = self._teacher_lp(session.teacher_params, batch_from_rollout(rows))
    return np.asarray(lp)[:, -width:]

  def close(self, loop: Loop) -> None:
    if self.file is not None:
      self.file.close()


def _step_of(line: str) -> int | None:
  try:
    return int(json.loads(line)["step"])
  except (ValueError, KeyError, TypeError):
    return None
