"""How a batch becomes vLLM requests: one seed per prompt, the sampling fields every request carries,
and the waves a CPU server's step budget splits a batch into (opdjax.rollout.vllm.engine)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from opdjax.rollout.base import SamplingParams


def prompt_seeds(seed: int, num_prompts: int) -> list[int]:
  """One distinct 63-bit seed per prompt, a pure function of (seed, index)."""
  states = np.random.SeedSequence(seed % 2**64).generate_state(num_prompts, np.uint64)
  return [int(s >> np.uint64(1)) for s in states]


def sampling_fields(sampling: SamplingParams, eos_ids: Sequence[int], seed: int) -> dict:
  """vLLM sampling fields (the completions API and `vllm.SamplingParams` share these names)."""
  return {
      "max_tokens": sampling.max_new_tokens,
      "temperature": sampling.temperature,
      "top_p": sampling.top_p,
      "top_k": sampling.top_k,  # 0 disables it in both
      # Neutral, so that only the settings above shape the distribution sampled from.
      "min_p": 0.0,
      "repetition_penalty": 1.0,
      "presence_penalty": 0.0,
      "frequency_penalty": 0.0,
      # The engine's EOS ids are the only stop rule: ignore_eos drops the model's own EOS and
      # generation_config's, stop_token_ids still stop (the EOS token is kept in the output).
      "ignore_eos": True,
      "stop_token_ids": [int(t) for t in eos_ids],
      "seed": seed,
      "logprobs": 0,  # the sampled token's log-prob only
  }


def waves(costs: Sequence[int], budget: int | None) -> list[range]:
  """Consecutive groups of requests whose costs sum to at most `budget`; one group when None."""
  if budget is None:
    return [range(len(costs))]
  out, start, total = [], 0, 0
  for i, cost in enumerate(costs):
    if total + cost > budget and i > start:
      out.append(range(start, i))
      start, total = i, 0
    total += cost
  out.append(range(start, len(costs)))
  return out
