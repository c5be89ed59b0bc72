"""The task interface: every member the pipeline, the analyses and the teacher seam use of a task, written
once. `opdjax.pipeline.build.make_task` builds one from the config (`task.name`); tests/test_tasks.py checks
that every task conforms.

A task hands out prompts (token ids) with a reference per prompt (`refs`: whatever its verifier or its
tags need, opaque to the pipeline), and judges completions of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


class Tokenizer(Protocol):
  def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class Task(Protocol):
  """`pad_id`, `eos_ids`: the ids engines pad with and stop at. `vocab_size`: the tokenizer's (every model
  must cover it). `tokenizer`: its `decode` renders samples. `has_verifier`: `is_correct` and `score` judge
  completions (False: `score` is None, `is_correct` refuses, held-out quality is the reverse KL alone)."""

  pad_id: int
  eos_ids: tuple[int, ...]
  vocab_size: int
  has_verifier: bool
  tokenizer: Tokenizer

  def train_batch(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], Sequence]:
    """`n` training prompts drawn with `rng` (the seed rule's) and their refs."""
    ...

  def eval_set(self) -> tuple[list[list[int]], Sequence | None]:
    """The held-out prompts and their refs (the same whatever the run's seed)."""
    ...

  def score(self, refs, completions: Sequence[Sequence[int]]) -> float | None:
    """The verifier's mean score of `completions` (None without a verifier)."""
    ...

  def is_correct(self, ref, completion: Sequence[int]) -> bool:
    """The verifier's judgement of one completion (GRPO's reward)."""
    ...

  def tags(self, refs) -> list[str | None]:
    """Each prompt's tag (`refs`: a training batch's; None: the held-out prompts'), which teacher.routes
    routes to a teacher of its own; None for an untagged prompt."""
    ...

  def check_tags(self, known: Sequence[str]) -> None:
    """Refuses, in one line naming the fix, a prompt whose tag is not in `known` (teacher.routes)."""
    ...
