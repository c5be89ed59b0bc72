"""Completion-length and repetition fields of a step's record (opdjax.pipeline.telemetry uses them; the loop
adds them to every record). A module of its own: the loop imports it, and the telemetry hooks import the loop."""

from __future__ import annotations

import numpy as np


def length_fields(completion_tokens, completion_mask, max_new_tokens: int, eos_ids) -> dict[str, float]:
  """`completion_len_mean/max` (tokens, EOS included), `truncated_frac` (rows at max_new_tokens without
  EOS) and `eos_frac` (rows whose last token is an EOS) of one step's completions (host arrays)."""
  toks, mask = np.asarray(completion_tokens), np.asarray(completion_mask, bool)
  lengths = mask.sum(-1)
  last = np.take_along_axis(toks, np.maximum(lengths - 1, 0)[:, None], -1)[:, 0]
  eos = (lengths > 0) & np.isin(last, np.asarray(list(eos_ids) or [-1]))
  return {"completion_len_mean": float(lengths.mean()), "completion_len_max": int(lengths.max()),
          "truncated_frac": float(((lengths >= max_new_tokens) & ~eos).mean()), "eos_frac": float(eos.mean())}


def repetition_fields(completion_tokens, completion_mask, eos_ids) -> dict[str, float]:
  """How repetitive one step's completions are: `distinct_frac`, the share of distinct tokens among all the
  step's completion tokens (EOS included: a batch of 24 spaces a row or of bare EOS is 1 distinct token in
  all of them), and `repeat_ngram_frac`, the mean share of a row (EOS left out; rows under 2 tokens count 0)
  that its longest n-gram occurring twice covers (overlaps count: 24 spaces: 23/24)."""
  toks, mask = np.asarray(completion_tokens), np.asarray(completion_mask, bool)
  if not mask.any():
    return {}
  eos = np.asarray(list(eos_ids) or [-1])
  repeat = []
  for row, m in zip(toks, mask):
    t = row[m]
    t = t[~np.isin(t, eos)]
    repeat.append(_longest_repeat(t) / len(t) if len(t) >= 2 else 0.0)
  return {"distinct_frac": float(len(np.unique(toks[mask])) / mask.sum()), "repeat_ngram_frac": float(np.mean(repeat))}


def _longest_repeat(t: np.ndarray) -> int:
  """The length of the longest run of tokens that occurs at two positions (overlapping allowed): the
  longest run of equal tokens between `t` and `t` shifted by d, over every shift d."""
  best = 0
  for d in range(1, len(t) - best):
    eq = np.concatenate([[False], t[d:] == t[:-d], [False]])
    edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
    if len(edges):
      best = max(best, int((edges[1::2] - edges[::2]).max()))
  return best


def with_lengths(score, rollout, eos_ids):
  """The step's score thunk (Sample.score) with the length and repetition fields added; read when the
  record is flushed (after the next step is dispatched), as the verifier's score is."""
  from opdjax.rollout.base import _host

  def thunk():
    out = score()
    toks, mask = _host(rollout.completion_tokens), _host(rollout.completion_mask)
    return {**out, **length_fields(toks, mask, rollout.sampling.max_new_tokens, eos_ids),
            **repetition_fields(toks, mask, eos_ids)}

  return thunk
