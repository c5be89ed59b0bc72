"""What the student writes, step by step: completion lengths, truncation and EOS shares (every record),
a few samples every `train.log_samples_every` steps (OUT/samples.jsonl and the trackers' tables), and the
length guard.

Length inflation (completions growing until they hit the cap) is the failure OPD users report most
after collapse; `truncated_frac` is the share of a step's rows that used all `max_new_tokens` without
ending on EOS. The length guard compares its mean over the last `train.length_guard_window` steps with
`train.length_guard_threshold`: `warn` records `length_guard_event` (and a progress line) when the share
first goes over, and again only after it came back down (a config whose cap is short by design warns
once, not every window); `halt` stops after the step, checkpointed, with one message naming the step and
the share. The collapse guard (`train.collapse_guard`) is the same window over entropy and the
distinct-token share, against the run's first window.
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


class CollapseHalt(LengthHalt):
  pass


class WindowGuard(Hook):
  """The base of the length and collapse guards: a window of the last `window` steps' values, at most one
  event a window, `warn` once until the signal has cleared, `halt` after the step (checkpointed). A subclass
  says what it reads from a record (`value`) and when a full window is over its threshold (`over`)."""

  name = ""
  halt_error = LengthHalt

  def __init__(self, policy: str, window: int, checkpointer=None, state: dict | None = None):
    self.policy, self.window, self.ckpt = policy, window, checkpointer
    state = state or {}
    self.values: collections.deque = collections.deque(state.get("values", []), maxlen=window)
    self.halted: tuple[int, str] | None = None
    self.armed = state.get("armed", True)

  def state(self) -> dict:
    """What a checkpoint keeps, so a resumed run's guard acts where the uninterrupted one would."""
    return {"values": list(self.values), "armed": self.armed}

  def value(self, rec: dict):
    raise NotImplementedError

  def over(self, rec: dict) -> str | None:
    """With a full window: what is over the threshold (a sentence), None when nothing is."""
    raise NotImplementedError

  def record(self, loop: Loop, rec: dict) -> None:
    v = self.value(rec)
    if v is None or self.halted is not None:
      return
    self.values.append(v)
    if len(self.values) < self.window:
      return
    over = self.over(rec)
    if over is None:
      self.armed = True
      return
    self.values.clear()  # at most one event a window
    if self.policy == "warn" and not self.armed:  # warned already: again once the signal has cleared
      return
    self.armed = False
    rec[f"{self.name}_event"] = over + (": halt" if self.policy == "halt" else f" (train.{self.name}=warn)")
    if self.policy == "halt":
      self.halted = (rec["step"], over)
      loop.stop = self.name

  def end(self, loop: Loop) -> None:
    if self.halted is None:
      return
    where = "" if self.ckpt is None else " " + self.ckpt.settled()
    raise self.halt_error(self.halt_message(*self.halted, where), list(loop.records))


class LengthGuardHook(WindowGuard):
  """Mean `truncated_frac` over the last `window` steps against `threshold` (see the module doc). Put it
  before the writers: it annotates the record they write."""

  name = "length_guard"

  def __init__(self, policy: str, threshold: float, window: int, checkpointer=None, state: dict | None = None):
    super().__init__(policy, window, checkpointer, state)
    self.threshold = threshold

  def value(self, rec: dict):
    return rec.get("truncated_frac")

  def over(self, rec: dict) -> str | None:
    share = sum(self.values) / self.window
    rec["length_guard_truncated"] = share
    self.share = share
    if share <= self.threshold:
      return None
    return (f"{share:.0%} of completions hit rollout.max_new_tokens over the last {self.window} steps (threshold"
            f" {self.threshold:.0%})")

  def halt_message(self, step: int, over: str, where: str) -> str:
    return (f"length guard: at step {step}, {self.share:.0%} of the last {self.window} steps' completions hit"
            f" rollout.max_new_tokens without EOS (train.length_guard_threshold={self.threshold}); halted.{where}"
            " The student's completions are growing to the cap (length inflation): look at samples.jsonl, raise"
            " rollout.max_new_tokens, or lower the learning rate, in a new --out.")


COLLAPSE_SIGNALS = ("entropy", "distinct_frac")  # what the collapse guard compares with the run's first window


class CollapseGuardHook(WindowGuard):
  """Collapse (every completion the same few tokens: 24 spaces, newlines, one digit repeated): the mean
  `entropy` (the sampled tokens' per-token entropy) and `distinct_frac` (opdjax.pipeline.lengths) over the last
  `window` steps against the same means over the run's first `window` steps (the reference, kept in
  checkpoints). Collapse is both under `ratio` x their references: a student that only grows sharper (entropy
  falling toward the teacher's) keeps writing varied tokens. `repeat_ngram_frac` is recorded beside them
  (`collapse_guard_*` fields of the window's last record) for the reader."""

  name = "collapse_guard"
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

  def halt_message(self, step: int, over: str, where: str) -> str:
    return (f"collapse guard: at step {step}, {self.said} (train.collapse_guard_ratio={self.ratio}); halted.{where}"
            " The student is collapsing onto a few tokens: look at samples.jsonl beside the teacher's completions,"
            " lower optim.learning_rate or keep more of the teacher's layers, in a new --out.")


class SamplesHook(Hook):
  """Every `every` steps: the first SAMPLES_PER_LOG rows of the step's rollout (prompt, completion, how
  it ended, the verifier's reward where the task has one, and the HIGHLIGHTS tokens with the largest
  per-token reverse-KL estimate log q(y) - log p_teacher(y), q the distribution the engine sampled from)
  to OUT/samples.jsonl and to every tracker's table."""

  def __init__(self, path: str, every: int, resume_step: int | None, write: bool = True):
    self.path, self.every, self.resume_step, self.file, self.write = path, every, resume_step, None, write
    self._teacher_lp = self._teacher_engine = None

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
    prompts = [[int(t) for t in pt[i][pm[i]]] for i in range(n)]
    theirs = self._teacher_completions(session, prompts, r.sampling.max_new_tokens)
    out = []
    for i in range(n):
      comp = [int(t) for t in ct[i][cm[i]]]
      ended = "eos" if comp and comp[-1] in task.eos_ids else (
          "truncated" if len(comp) >= r.sampling.max_new_tokens else "stopped")
      row = {"step": step, "row": i, "prompt": decode(prompts[i]),
             "completion": decode(comp), "completion_tokens": len(comp), "ended": ended}
      if theirs is not None:  # what the teacher itself writes for the prompt (greedy), to read beside it
        row["teacher_completion"] = decode([t for t in theirs[i] if t not in task.eos_ids])
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

  def _teacher_completions(self, session, prompts: list[list[int]], max_new_tokens: int):
    """The trainer's teacher's greedy completions of `prompts` (an engine of its own, kept for the run);
    None with a served teacher or several processes."""
    import jax

    if session.teacher is None or jax.process_count() > 1:
      return None
    from opdjax.rollout import SamplingParams
    from opdjax.rollout.deploy import jax_engine

    if self._teacher_engine is None:
      self._teacher_engine = jax_engine(session.teacher, session.teacher_params, max_len=session.cfg.rollout.max_len,
                                        pad_id=session.task.pad_id, eos_ids=session.task.eos_ids)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    return self._teacher_engine.generate(prompts, greedy, seed=0).completions()

  def close(self, loop: Loop) -> None:
    if self.file is not None:
      self.file.close()
    if self._teacher_engine is not None:
      self._teacher_engine.close()


def _step_of(line: str) -> int | None:
  try:
    return int(json.loads(line)["step"])
  except (ValueError, KeyError, TypeError):
    return None
