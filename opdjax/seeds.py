"""All randomness of a run derives from one rule: (seed, step, purpose).

A training run with seed s draws step t's prompts from `rng(s, t, "prompts")`, samples with
`derive(s, t, "sample")`, and the noise of params version v from `key(s, v, "noise", noise_seed)`.
`opdjax train`, the sweeps and the warm-ups all use it, so the same (seed, view) gives the same run
whoever runs it.
"""

from __future__ import annotations

import jax
import numpy as np

PURPOSES = {"prompts": 1, "sample": 2, "noise": 3, "eval": 4, "eval_greedy": 5, "teacher_preflight": 6}


def derive(seed: int, step: int, purpose: str, *extra: int) -> int:
  """A 31-bit integer seed for (seed, step, purpose, *extra)."""
  entropy = [int(seed), int(step), PURPOSES[purpose], *map(int, extra)]
  return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0] >> 1)


def rng(seed: int, step: int, purpose: str, *extra: int) -> np.random.Generator:
  return np.random.default_rng(derive(seed, step, purpose, *extra))


def key(seed: int, step: int, purpose: str, *extra: int) -> jax.Array:
  return jax.random.key(derive(seed, step, purpose, *extra))
