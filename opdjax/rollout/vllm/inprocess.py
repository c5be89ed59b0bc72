"""vLLM's offline `vllm.LLM` in this process behind the `RolloutEngine` protocol (tests, notebooks)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from opdjax.models.config import ModelConfig
from opdjax.rollout.vllm.client import LOGPROBS_MODE, ServerInfo, VllmError
from opdjax.rollout.vllm.engine import VllmEngineBase
from opdjax.rollout.vllm.exporter import served_untied
from opdjax.rollout.vllm.server import INSTALL_HINT


class VllmInProcessEngine(VllmEngineBase):
  """Rollouts from `vllm.LLM` in this process: no server, no HTTP.

  vLLM keeps its engine core in a child process unless `VLLM_ENABLE_V1_MULTIPROCESSING=0` is
  set before the engine is built. On vLLM's CPU backend this engine sets
  `VLLM_CPU_OMP_THREADS_BIND=nobind` unless it is set already: by default vLLM pins the calling
  process's threads to its cores, which would also pin the trainer. `llm_kwargs` go to
  `vllm.LLM` (e.g. dtype, quantization, kv_cache_dtype, gpu_memory_utilization, tensor_parallel_size,
  max_model_len, max_num_batched_tokens, enforce_eager).
  """

  def __init__(self, model: str | os.PathLike, model_cfg: ModelConfig, *, pad_id: int,
               eos_ids: Sequence[int] | None = None, version: int = 0, export_dir: str | None = None, **llm_kwargs):
    try:
      import vllm
    except ImportError as e:
      raise VllmError(f"rollout.engine='vllm' needs vLLM, which does not import here ({e}); {INSTALL_HINT}.") from e
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    self._vllm = vllm
    self.llm = vllm.LLM(model=os.fspath(model), skip_tokenizer_init=True, logprobs_mode=LOGPROBS_MODE,
                        generation_config="vllm", **llm_kwargs)
    config = self.llm.llm_engine.vllm_config
    info = ServerInfo(max_model_len=config.model_config.max_model_len,
                      max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                      split_breaks_seeds=(config.device_config.device_type == "cpu"
                                          and config.scheduler_config.enable_chunked_prefill))
    precision = (str(config.model_config.dtype).replace("torch.", ""), str(config.model_config.quantization or ""))
    super().__init__(model_cfg, pad_id=pad_id, eos_ids=eos_ids, version=version, export_dir=export_dir, info=info,
                     precision=precision, untie=served_untied(model, model_cfg))

  def _reload(self, path: str) -> None:
    self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    if not self.llm.reset_prefix_cache():
      raise VllmError("vLLM could not reset its prefix cache after a weight reload (requests still running).")

  def _probe_servers(self, tokens):
    from vllm.inputs import TokensPrompt

    sp = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], [sp], use_tqdm=False)
    return [("vllm.LLM in this process", [out.prompt_logprobs[i][t].logprob for i, t in enumerate(tokens) if i])]

  def _sample(self, prompts, fields):
    from vllm.inputs import TokensPrompt

    params = [self._vllm.SamplingParams(**f, detokenize=False) for f in fields]
    outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
      c = o.outputs[0]
      result.append((list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]))
    return result
