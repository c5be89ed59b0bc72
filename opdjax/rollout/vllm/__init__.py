"""vLLM as a rollout engine: a supervised server (`server`), its HTTP client (`client`), the engine
with weight sync (`engine`; built by opdjax.rollout.vllm.launch), its requests (`requests`), weights exporter
(`exporter`) and reload probe (`probe`), and an in-process variant for tests (`inprocess`).

vllm itself is imported lazily (only by `VllmInProcessEngine`): opdjax imports without it, and the
server may run from another Python environment (`rollout.vllm.python`). The names below load on first use
(PEP 562): the server imports `auth` as its middleware, which needs none of them (nor JAX).
"""

import importlib

_WHERE = {"LOGPROBS_MODE": "client", "VllmClient": "client", "VllmError": "client", "VllmEngine": "engine",
          "VllmInProcessEngine": "inprocess", "prompt_seeds": "requests", "sampling_fields": "requests",
          "waves": "requests", "VllmServer": "server", "first_error_block": "server"}

__all__ = ["LOGPROBS_MODE", "VllmClient", "VllmEngine", "VllmError", "VllmInProcessEngine", "VllmServer",
           "first_error_block", "prompt_seeds", "sampling_fields", "waves"]


def __getattr__(name: str):
  if name in _WHERE:
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
