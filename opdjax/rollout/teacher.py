"""Teacher scoring where the rollout is sampled (`rollout.teacher_scoring='engine'`): the teacher's
final hidden states on a rollout's sequences, computed in the rollout engine's process and returned
with the rollout, so the OPD step runs only the teacher's output matrix (its LM head) in the fused
loss, not its layers. slime and verl score the teacher on the inference side the same way.

The sequence layout is defined once, here (`model_inputs`): the trainer's re-scoring batch
(opdjax.scoring.rescore.batch_from_rollout) is built from it too, so the hidden states line up with
the batch's tokens, positions and attention mask by construction (prompts left-padded, completions
right-padded, the last token dropped: position i predicts token i + 1).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from opdjax.models.decoder import Model, positions_from_mask
from opdjax.rollout.base import Rollout


def model_inputs(prompt_tokens, prompt_mask, completion_tokens, completion_mask) -> dict[str, jax.Array]:
  """A rollout's sequences as the models read them, `[B, L = P + N - 1]`: `tokens[:, i]` predicts
  `targets[:, i]`; `positions` restart at 0 on each row's first real token."""
  tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
  return {
      "tokens": tokens[:, :-1],
      "positions": positions_from_mask(mask)[:, :-1],
      "attention_mask": mask[:, :-1],
      "targets": tokens[:, 1:],
  }


@flax.struct.dataclass
class ScoredRollout(Rollout):
  """A rollout with the teacher's final hidden states on its sequences, `[B, L, D]` in the teacher's
  compute dtype, aligned with `model_inputs` (what `teacher.hidden` returns in the OPD step)."""

  teacher_hidden: jax.Array | None = None


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
