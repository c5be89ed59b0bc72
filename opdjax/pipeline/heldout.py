"""Held-out evaluation: one compiled loss and one engine, shared by the loop and the sweeps."""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os

import jax
import numpy as np

from opdjax import seeds
from opdjax.models import Model
from opdjax.parallel.placement import SINGLE
from opdjax.rollout import Rollout, SamplingParams
from opdjax.rollout.base import pad_prompts
from opdjax.rollout.deploy import jax_engine
from opdjax.scoring.rescore import batch_from_rollout, masked_mean, token_logprobs
from opdjax.training.loss import LossConfig
from opdjax.training.step import opd_loss

TEACHER_FILE = "heldout_teacher.json"  # the teacher's greedy completions, in the run's folder


class HeldOut:
  """Held-out quality of a student: reverse KL to the teacher on the student's own samples (full
  vocabulary), and the verifier's score of its greedy answers; one compiled loss and one engine. With a
  served teacher (`served`: a callable rollout -> its answer, opdjax.rollout.vllm.teacher) the reverse KL is
  the sampled-token estimate mean(log p_s(y) - log p_t(y)) on the same samples: unbiased for the same
  quantity, noisier (no full distribution comes back from a server).

  The student's own samples cannot tell a student that learned from one that collapsed onto tokens the
  teacher also finds likely after themselves (spaces after spaces score well). So, with the teacher in the
  trainer, two measures from the teacher's side: `teacher_nll`, the student's per-token NLL on the
  teacher's greedy completions of the held-out prompts, and `teacher_f1`, the token-level F1 of the
  student's greedy answer against the teacher's (EOS left out; two empty answers agree). The teacher's
  completions are generated once per run and kept in `cache_dir`/heldout_teacher.json, which a resumed run
  reads back (the same prompts: the same completions)."""

  def __init__(self, student: Model, teacher: Model | None, task, sampling: SamplingParams, chunk: int, seed: int,
               engine_kw: dict, served=None, cache_dir: str | None = None):
    kind = "full_rkl" if served is None else "sampled_rkl"
    self.served = served
    self.loss = jax.jit(functools.partial(opd_loss, student=student, teacher=teacher,
                                          loss_cfg=LossConfig(kind=kind, chunk=chunk)))
    self.engine = jax_engine(student, **engine_kw)
    self.prompts, self.refs = task.eval_set()
    self.task, self.sampling, self.seed = task, sampling, seeds.derive(seed, 0, "eval")
    self.greedy = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=0.0)
    self.teacher, self.engine_kw, self.cache_dir = (teacher if served is None else None), engine_kw, cache_dir
    self.nll = jax.jit(lambda params, b: -masked_mean(token_logprobs(student, params, b, chunk=chunk),
                                                      b["loss_mask"]))
    self._teacher_answers: list[list[int]] | None = None

  def __call__(self, params, teacher_params, version: int = 0) -> tuple[dict, Rollout]:
    """(metrics, the sampled held-out rollout)."""
    self.engine.sync(params, version)
    r = self.engine.generate(self.prompts, self.sampling, seed=self.seed)
    batch = batch_from_rollout(r)
    if self.served is not None:
      batch = {**batch, **self.served(r)}
    _, m = self.loss(params, teacher_params, batch)
    out = {"reverse_kl": float(m["reverse_kl"])}
    teacher_side = self.teacher is not None
    if self.task.has_verifier or teacher_side:
      answers = self.engine.generate(self.prompts, self.greedy, seed=0).completions()
    if self.task.has_verifier:  # (prompts without a verifier: no greedy pass to score)
      out["accuracy"] = self.task.score(self.refs, answers)
    if teacher_side:
      theirs = self.teacher_answers(teacher_params)
      out["teacher_nll"] = float(self.nll(params, self._teacher_batch(theirs)))
      eos = set(self.task.eos_ids)
      out["teacher_f1"] = float(np.mean([token_f1(_strip(a, eos), _strip(t, eos)) for a, t in zip(answers, theirs)]))
    return out, r

  def teacher_answers(self, teacher_params) -> list[list[int]]:
    """The teacher's greedy completions of the held-out prompts: generated on first use (an engine of
    the teacher's, closed after), or read back from the run's cache file when its prompts are these."""
    if self._teacher_answers is not None:
      return self._teacher_answers
    path = None if self.cache_dir is None else os.path.join(self.cache_dir, TEACHER_FILE)
    key = _prompts_key(self.prompts, self.greedy.max_new_tokens)
    if path is not None and os.path.exists(path):
      with open(path) as f:
        kept = json.load(f)
      if kept.get("key") == key:
        self._teacher_answers = kept["completions"]
        return self._teacher_answers
    engine = jax_engine(self.teacher, **self.engine_kw)
    try:
      engine.sync(teacher_params, 0)
      self._teacher_answers = engine.generate(self.prompts, self.greedy, seed=0).completions()
    finally:
      engine.close()
    placement = self.engine_kw.get("placement") or SINGLE
    if path is not None and placement.primary:
      os.makedirs(self.cache_dir, exist_ok=True)
      with open(path + ".tmp", "w") as f:
        json.dump({"key": key, "max_new_tokens": self.greedy.max_new_tokens,
                   "completions": self._teacher_answers}, f)
      os.replace(path + ".tmp", path)
    return self._teacher_answers

  def _teacher_batch(self, completions: list[list[int]]):
    """The scoring batch of the held-out prompts followed by `completions` (right-padded), placed as
    the engine places its rollouts."""
    placement = self.engine_kw.get("placement") or SINGLE
    toks, mask = pad_prompts(self.prompts, self.engine_kw["pad_id"])
    width = max(1, self.greedy.max_new_tokens)
    ctoks = np.full((len(completions), width), self.engine_kw["pad_id"], np.int32)
    cmask = np.zeros((len(completions), width), bool)
    for i, c in enumerate(completions):
      ctoks[i, :len(c)], cmask[i, :len(c)] = c, True
    n, rows = len(completions), placement.rows(len(completions))
    r = Rollout(*(placement.batch(a[rows], n) for a in (toks, mask, ctoks, cmask)),
                rollout_logprobs=placement.batch(np.zeros(ctoks.shape, np.float32)[rows], n))
    return batch_from_rollout(r)


def token_f1(pred, ref) -> float:
  """Token-level F1 of two token sequences as bags (SQuAD's answer F1 over the model's own tokens)."""
  if not pred and not ref:
    return 1.0
  common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(pred), common / len(ref)
  return 2 * precision * recall / (precision + recall)


def _strip(tokens: list[int], eos: set) -> list[int]:
  return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def _prompts_key(prompts, max_new_tokens: int) -> str:
  h = hashlib.sha256(json.dumps([[int(t) for t in p] for p in prompts]).encode())
  h.update(str(max_new_tokens).encode())
  return h.hexdigest()[:16]
