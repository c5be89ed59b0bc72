"""Samples of what the student writes: every `train.log_samples_every` steps, the first few rows of the
step's rollout to OUT/samples.jsonl and to every writer's table (W&B, trackio), with the teacher's own
completion of the prompt beside each and the tokens the teacher disagrees with most."""

from __future__ import annotations

import json

import numpy as np

from opdjax.pipeline.loop import Loop
from opdjax.pipeline.writers.base import Writer, keep_until
from opdjax.rollout.base import to_host

SAMPLES_PER_LOG = 4  # rows of the step's rollout each samples.jsonl entry shows
HIGHLIGHTS = 5  # tokens per sample with the largest per-token reverse-KL estimate


class SamplesWriter(Writer):
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
    if self.resume_step is not None:  # a resumed run logs each step once
      keep_until(self.path, self.resume_step)
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
      if isinstance(h, Writer):
        h.table(step, flat)

  def rows(self, loop: Loop, sample, step: int) -> list[dict]:
    session, r = loop.session, sample.rollout
    task = session.task
    decode = task.tokenizer.decode  # every task's tokenizer (HF's, the addition task's characters)
    n = min(SAMPLES_PER_LOG, int(np.asarray(r.completion_mask).shape[0]))
    pt, pm = to_host(r.prompt_tokens)[:n], to_host(r.prompt_mask)[:n].astype(bool)
    ct, cm = to_host(r.completion_tokens)[:n], to_host(r.completion_mask)[:n].astype(bool)
    q = to_host(r.rollout_logprobs)[:n]
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
      return np.asarray(to_host(inputs["teacher_logprobs"]))[:n, -width:]
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
