"""Completion-length fields of a step's record (opdjax.pipeline.telemetry uses them; the loop adds them to
every record). A module of its own: the loop imports it, and the telemetry hooks import the loop."""

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


def with_lengths(score, rollout, eos_ids):
  """The step's score thunk (Sample.score) with the length fields added; read when the record is
  flushed (after the next step is dispatched), as the verifier's score is."""
  from opdjax.rollout.base import _host

  def thunk():
    out = score()
    return {**out, **length_fields(_host(rollout.completion_tokens), _host(rollout.completion_mask),
                                   rollout.sampling.max_new_tokens, eos_ids)}

  return thunk
