"""Teacher scoring where the rollout is sampled (`rollout.teacher_scoring='engine'`): the teacher's
final hidden states on a rollout's sequences, computed in the rollout engine's process and returned
with the rollout, so the OPD step runs only the teacher's output matrix (its LM head) in the fused
loss, not its layers. slime and verl score the teacher on the inference side the same way.

The sequence layout is the rollout's own (opdjax.rollout.base.model_inputs), which the trainer's
re-scoring batch (opdjax.scoring.rescore.batch_from_rollout) is built from too, so the hidden states
line up with the batch's tokens, positions and attention mask by construction.
"""

from __future__ import annotations

import functools

import jax

from opdjax.models.decoder import Model
from opdjax.rollout.base import Rollout, model_inputs


@functools.partial(jax.jit, static_argnums=0)
def _hidden(teacher: Model, params, prompt_tokens, prompt_mask, completion_tokens, completion_mask):
  x = model_inputs(prompt_tokens, prompt_mask, completion_tokens, completion_mask)
  return teacher.hidden(params, x["tokens"], x["positions"], x["attention_mask"])[0]


class TeacherScorer:
  """The fixed teacher (its config with the trainer's view already applied, and its params), scoring
  rollouts: `scorer(rollout)` -> hidden states `[B, L, D]`, compiled once per batch shape."""

  def __init__(self, teacher: Model, params):
    self.teacher, self.params = teacher, params

  def __call__(self, rollout: Rollout) -> jax.Array:
    return _hidden(self.teacher, self.params, rollout.prompt_tokens, rollout.prompt_mask, rollout.completion_tokens,
                   rollout.completion_mask)
