"""vLLM as a rollout engine: a supervised server (`server`), its HTTP client (`client`), the engine
with weight sync (`engine`; built by opdjax.rollout.vllm.launch), its requests (`requests`), weights exporter
(`exporter`) and reload probe (`probe`), and an in-process variant for tests (`inprocess`).

vllm itself is imported lazily (only by `VllmInProcessEngine`): opdjax imports without it, and the
server may run from another Python environment (`rollout.vllm.python`).
"""

from opdjax.rollout.vllm.client import LOGPROBS_MODE, VllmClient, VllmError
from opdjax.rollout.vllm.engine import VllmEngine
from opdjax.rollout.vllm.inprocess import VllmInProcessEngine
from opdjax.rollout.vllm.requests import prompt_seeds, sampling_fields, waves
from opdjax.rollout.vllm.server import VllmServer, first_error_block

__all__ = ["LOGPROBS_MODE", "VllmClient", "VllmEngine", "VllmError", "VllmInProcessEngine", "VllmServer",
           "first_error_block", "prompt_seeds", "sampling_fields", "waves"]
