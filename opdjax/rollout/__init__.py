"""Rollout engines. The names below load on first use (PEP 562): a vLLM server imports this package's
`vllm.auth` as its middleware, and the token check needs neither JAX nor the engines."""

import importlib

_WHERE = {"PromptTooLongError": "opdjax.rollout.base", "Rollout": "opdjax.rollout.base",
          "RolloutEngine": "opdjax.rollout.base", "SamplingParams": "opdjax.rollout.base",
          "JaxEngine": "opdjax.rollout.jax.engine"}

__all__ = ["JaxEngine", "PromptTooLongError", "Rollout", "RolloutEngine", "SamplingParams"]


def __getattr__(name: str):
  if name in _WHERE:
    return getattr(importlib.import_module(_WHERE[name]), name)
  raise AttributeError(f"module 'opdjax.rollout' has no attribute {name!r}")
