"""vLLM behind the `RolloutEngine` protocol: weight sync, request mapping, rollout assembly.

Weight sync: `export` writes the params as an HF folder in the server's dtype (bf16 for a bf16 or
FP8 server), shard by shard from every trainer process (opdjax.rollout.vllm.weights), a fresh folder for
every sync (in shared memory, /dev/shm, when a single-process engine started its server); `load` has
vLLM pause (letting requests in flight finish), `reload_weights(weights_path=...)` in place, reset
its prefix cache (cached KV blocks were computed with the old weights) and resume, then has every
server score the probe and compares it with the trainer's scores of the params sent: a server that
does not hold them is one error naming it (a warning with `probe_action='warn'`). The params arrive
already fake-quantized, noised or lagged (`capabilities`); vLLM's own precision is its `--dtype` /
`--quantization` / `--kv-cache-dtype`.

Every prompt is its own request with its own seed. A CPU server dies when it splits a seeded
request's prefill across steps (see `ServerInfo.split_breaks_seeds`), so on such a server a batch is
sent in waves whose tokens fit its step budget (`--max-num-batched-tokens`); the factory
(`opdjax.rollout.vllm.launch.make_vllm_engine`) sizes that budget so one wave holds a whole batch.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from opdjax.models.config import ModelConfig
from opdjax.rollout.base import (
  Capabilities,
  PromptTooLongError,
  Rollout,
  RolloutEngine,
  SamplingParams,
  WeightUpdate,
  pad_prompts,
)
from opdjax.rollout.vllm.client import ServerDown, ServerInfo, VllmClient, VllmError, error_message, http_json
from opdjax.rollout.vllm.exporter import HfExporter, served_untied
from opdjax.rollout.vllm.probe import ProbeHistory, check_probe
from opdjax.rollout.vllm.requests import prompt_seeds, sampling_fields, waves
from opdjax.rollout.vllm.server import VllmServer

log = logging.getLogger(__name__)


class VllmEngineBase(RolloutEngine):
  """Weight export, sampling settings, waves and rollout assembly; subclasses sample and reload."""

  capabilities = Capabilities(view_parts=frozenset({"weights", "noise_sigma", "lag"}), packed_weights=False,
                              processed_logprobs=True)

  def __init__(self, model_cfg: ModelConfig, *, pad_id: int, eos_ids: Sequence[int] | None, version: int,
               export_dir: str | None, info: ServerInfo, precision: tuple[str, str], probe_tolerance: float = 0.0,
               probe_action: str = "error", untie: bool = False):
    """`precision`: the server's (dtype, quantization), which the weights are exported for;
    `probe_tolerance` (0: the default of that precision) and `probe_action` (error, warn): the
    reload check; `untie`: the server holds a tied model's LM head as its own tensor."""
    self.model_cfg = model_cfg
    self.pad_id = pad_id
    self.eos_ids = tuple(model_cfg.eos_ids if eos_ids is None else eos_ids)
    self.max_len = info.max_model_len
    # A request costs at most its prompt plus its new tokens in any step (prefill, or recomputing
    # after a preemption); waves keep a step's requests within the budget when a split would kill it.
    self.token_budget = info.max_num_batched_tokens if info.split_breaks_seeds else None
    if export_dir is not None:
      os.makedirs(export_dir, exist_ok=True)
    self._export_root = tempfile.mkdtemp(prefix="opdjax-vllm-weights-", dir=export_dir)
    # Exports are model-sized: removed by close(), or when the engine is collected or Python exits.
    self._cleanup = weakref.finalize(self, shutil.rmtree, self._export_root, ignore_errors=True)
    self.exporter = HfExporter(model_cfg, self._export_root, *precision, tolerance=probe_tolerance, untie=untie)
    if probe_action not in ("error", "warn"):
      raise VllmError(f"probe_action={probe_action!r}; choose 'error' or 'warn'.")
    self.probe_action = probe_action
    self._probe_history = ProbeHistory()  # each server's answer at the last sync it passed
    self._weights_path: str | None = None  # the folder vLLM holds now, when opdjax wrote it
    self._version = version

  @property
  def params_version(self) -> int:
    return self._version

  @property
  def weights_path(self) -> str | None:
    return self._weights_path

  def release(self, update: WeightUpdate) -> None:
    """A version dropped unloaded: its folder goes (never the one the servers hold)."""
    if update.path and update.path != self._weights_path:
      shutil.rmtree(update.path, ignore_errors=True)

  def hold(self, folder: str) -> None:
    """`folder`, which the servers started from, becomes the weights they hold (moved under the export
    root): a restart before the first sync starts from it, the first sync removes it."""
    self._weights_path = shutil.move(folder, os.path.join(self._export_root, f"000000-v{self._version}"))

  def sync(self, params, version: int) -> None:
    """Exports `params` to a fresh HF folder and has vLLM reload it in place."""
    self.load(self.export(params, version))

  def export(self, params, version: int) -> WeightUpdate:
    """`params` written to a fresh HF folder under the engine's export root, in the server's dtype;
    with several trainer processes the PrimaryEngine calls the same exporter on every process."""
    return self.exporter.export(params, version)

  def load(self, update: WeightUpdate) -> None:
    """Has vLLM reload the exported folder in place (pause, reload, reset prefix cache, resume),
    then checks every server with the probe."""
    t0 = time.perf_counter()
    try:
      self._reload(update.path)
    except BaseException as e:
      shutil.rmtree(update.path, ignore_errors=True)
      if isinstance(e, VllmError) and "Cannot find any model weights" in str(e):
        raise VllmError(f"a vLLM server cannot read the weights folder {update.path} ({e}): the server's host"
                        " does not see the trainer's export folder. Set rollout.vllm.export_dir to a folder the"
                        " trainer's processes and every server host mount at the same path.") from e
      raise
    update.stats["time_reload_s"] = time.perf_counter() - t0
    old, self._weights_path, self._version = self._weights_path, update.path, update.version
    if old is not None and old != update.path:
      shutil.rmtree(old, ignore_errors=True)
    if update.probe is not None:
      check_probe(update, self.exporter, self._probe_servers, self.model_cfg.tie_word_embeddings, self.probe_action,
                  self._probe_history)

  def _probe_servers(self, tokens: list[int]) -> list[tuple[str, list[float]]]:
    """(url, log-probs of tokens[1:]) of each server that holds the current weights."""
    raise NotImplementedError

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int = 0) -> Rollout:
    toks, mask = pad_prompts(prompts, self.pad_id)
    costs = [len(p) + sampling.max_new_tokens for p in prompts]
    if self.max_len is not None and max(costs) > self.max_len:
      raise PromptTooLongError(
          f"prompt of {max(costs) - sampling.max_new_tokens} tokens + max_new_tokens={sampling.max_new_tokens}"
          f" exceeds vLLM's max_model_len={self.max_len}; shorten the prompt or raise the server's max_model_len.")
    if self.token_budget is not None and max(costs) > self.token_budget:
      raise VllmError(f"a prompt of {max(costs) - sampling.max_new_tokens} tokens + {sampling.max_new_tokens} new"
                      f" tokens exceeds the CPU vLLM server's --max-num-batched-tokens={self.token_budget}: it would"
                      " split the request's prefill, which kills a CPU server under per-request seeds. Restart it"
                      " with --max-num-batched-tokens of at least the max_model_len.")
    fields = [sampling_fields(sampling, self.eos_ids, s) for s in prompt_seeds(seed, len(prompts))]
    groups = waves(costs, self.token_budget)
    if len(groups) > 1:
      log.info("vLLM: %d prompts in %d waves of at most %d tokens (--max-num-batched-tokens)",
               len(prompts), len(groups), self.token_budget)
    outs = []
    for group in groups:  # per-prompt seeds: the same tokens whatever the grouping
      outs += self._sample([[int(t) for t in prompts[i]] for i in group], [fields[i] for i in group])
    b, n = len(prompts), sampling.max_new_tokens
    tokens = np.full((b, n), self.pad_id, np.int32)
    cmask = np.zeros((b, n), bool)
    lps = np.zeros((b, n), np.float32)
    for i, (t, lp) in enumerate(outs):
      if not 0 < len(t) <= n or len(lp) != len(t) or any(x is None for x in lp):
        raise VllmError(f"vLLM returned {len(t)} tokens and {len(lp)} log-probs for prompt {i} (asked for at most"
                        f" {n}, one log-prob each); the server is not one opdjax can drive: use vLLM >= 0.32.")
      tokens[i, :len(t)] = t
      cmask[i, :len(t)] = True
      lps[i, :len(t)] = lp
    return Rollout(prompt_tokens=jnp.asarray(toks), prompt_mask=jnp.asarray(mask),
                   completion_tokens=jnp.asarray(tokens), completion_mask=jnp.asarray(cmask),
                   rollout_logprobs=jnp.asarray(lps), params_version=self._version, sampling=sampling, seed=seed)

  def close(self) -> None:
    self._cleanup()
    self._weights_path = None

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @abc.abstractmethod
  def _sample(self, prompts: list[list[int]], fields: list[dict]) -> list[tuple[list[int], list[float]]]:
    """(completion token ids, their log-probs) per prompt, all or nothing."""

  @abc.abstractmethod
  def _reload(self, path: str) -> None:
    ...


def server_precision(config: dict) -> tuple[str, str]:
  """(dtype, quantization) a server runs with, from its config (`VllmClient.config()`)."""
  model = config.get("model_config", {})
  return str(model.get("dtype", "")).replace("torch.", ""), str(model.get("quantization") or "")


class VllmEngine(VllmEngineBase):
  """Rollouts from a vLLM server: one completion request per prompt, sent concurrently.

  One request per prompt (n=1) rather than one request listing every prompt: vLLM seeds per
  request, so a multi-prompt request would draw the same random stream for every prompt, while
  here each prompt gets its own seed; a request that times out is retried alone; and vLLM's
  continuous batching runs concurrent requests in the same forward passes anyway.

  `server` is a `VllmServer` or the URL of a running one. A `VllmServer` that is not running yet is
  started here and stopped by `close()`; one that dies is restarted from the latest synced weights
  (at most `max_restarts` times, and never again once it died the same way twice) and the batch is
  requested again. A server given by URL that dies is an error naming the fix. Either way
  `generate` returns a full rollout for the batch or raises. One engine per server: weight sync
  changes the server's weights for every client.
  """

  def __init__(self, server: VllmServer | str, model_cfg: ModelConfig, *, pad_id: int,
               eos_ids: Sequence[int] | None = None, version: int = 0, api_key: str | None = None,
               export_dir: str | None = None, request_timeout_s: float = 600.0, max_retries: int = 2,
               max_restarts: int = 1, max_concurrency: int = 64, shm: bool = True, probe_tolerance: float = 0.0,
               probe_action: str = "error"):
    """`shm`: exports go through /dev/shm when this engine starts a local server (one trainer process
    writes them and the server reads them on this host) and the model fits there twice."""
    self._server = server if isinstance(server, VllmServer) else None
    self._owns_server = self._server is not None and not self._server.ready  # launched here or by the factory
    if self._server is not None:
      self._server.start()
      api_key = self._server.api_key if api_key is None else api_key
    try:
      self.client = VllmClient(self._server.url if self._server else str(server), api_key=api_key,
                               token=(self._server.token or "") if self._server else None,  # URL: env's
                               request_timeout_s=request_timeout_s, max_retries=max_retries)
      try:
        config = self.client.config()
        info, precision = self.client.info(config), server_precision(config)
      except (ServerDown, OSError) as e:
        raise VllmError(self._down_message(e)) from e
    except BaseException:
      if self._owns_server:
        self._server.stop()
      raise
    self.max_restarts = max_restarts
    self._pool = cf.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="opdjax-vllm")
    if shm and self._owns_server and _fits_in_shm(self._server.model):  # a local server: weights through memory
      export_dir = "/dev/shm"
    untie = self._server is not None and served_untied(self._server.model, model_cfg)
    super().__init__(model_cfg, pad_id=pad_id, eos_ids=eos_ids, version=version, export_dir=export_dir, info=info,
                     precision=precision, probe_tolerance=probe_tolerance, probe_action=probe_action, untie=untie)

  def tags(self, version: int) -> dict:
    return {"rollout_servers": [{"url": self.url, "version": version}]}

  @property
  def url(self) -> str:
    return self.client.url

  @property
  def server(self) -> VllmServer | None:
    return self._server

  def _down_message(self, err, again: bool = False) -> str:
    if self._server is None:
      return (f"the vLLM server at {self.url} is not answering ({err}): it died or was stopped. Restart it with"
              " VLLM_SERVER_DEV_MODE=1 (see VllmServer.command() for the flags opdjax needs) and rerun the step,"
              " or leave rollout.vllm.url empty so that opdjax starts and restarts the server itself.")
    what = ("died again after a restart, the same way, so opdjax stopped restarting it" if again else
            "is not answering: it died or was stopped")
    return (f"the vLLM server at {self.url} {what} ({err}); {self._server.failure()}\n"
            "Fix the cause above; flags go through rollout.vllm.extra_args.")

  def _restart(self, model: str | None) -> None:
    self._server.restart(model=model)  # starts from the latest weights: nothing left to reload
    self.client.url = self._server.url  # a restart may pick another port

  def _reload(self, path: str) -> None:
    try:
      # pause -> load -> reset prefix cache -> resume: a request another client has in flight finishes
      # on the old weights before the load ("wait") instead of on a mix of both.
      paused = self._control("/pause?mode=wait")
      try:
        if os.environ.get("OPDJAX_FAULT") == "skip_reload":  # tests only: a server that keeps its old weights
          log.warning("OPDJAX_FAULT=skip_reload: %s keeps its weights instead of loading %s", self.url, path)
        else:
          self.client.reload(path)  # reload_weights, then reset_prefix_cache (stale KV blocks)
      finally:
        if paused:
          self._control("/resume")
    except ServerDown as e:
      if self._server is None or self.max_restarts < 1:
        raise VllmError(self._down_message(e)) from e
      log.warning("vLLM server died during weight sync (%s); restarting it from %s", e, path)
      self._restart(path)

  def _probe_servers(self, tokens):
    return [(self.url, self.score_prompt(tokens))]

  def score_prompt(self, tokens: list[int]) -> list[float]:
    """The server's log-probs of tokens[1:] given the tokens before each (prompt_logprobs)."""
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "ignore_eos": True}
    try:
      status, payload = http_json(self.url + "/v1/completions", body, bearer=self.client.bearer,
                                  timeout=self.client.request_timeout_s)
    except OSError as e:
      raise VllmError(self._down_message(ServerDown(f"{type(e).__name__}: {e}"))) from e
    if status != 200:
      raise VllmError(f"vLLM refused the weight probe (POST {self.url}/v1/completions: HTTP {status}:"
                      f" {error_message(payload)})")
    try:
      entries = payload["choices"][0]["prompt_logprobs"][1:]
      return [float(e[str(t)]["logprob"]) for e, t in zip(entries, tokens[1:], strict=True)]
    except (KeyError, IndexError, TypeError, ValueError) as e:
      raise VllmError(f"vLLM answered the weight probe without prompt log-probs ({e!r}); opdjax needs"
                      " vLLM >= 0.32.") from e

  def _control(self, route: str) -> bool:
    """POST a generation-control route (vLLM's dev-mode RL routes); False where the server has none."""
    try:
      status, payload = http_json(self.url + route, {}, bearer=self.client.bearer,
                                  timeout=self.client.request_timeout_s)
    except OSError as e:
      raise ServerDown(f"{type(e).__name__}: {e}") from e
    if status == 404:
      return False  # an older vLLM: nothing to pause, weights load between our batches anyway
    if status != 200:
      raise VllmError(f"POST {self.url}{route} answered HTTP {status}: {error_message(payload)}")
    return True

  def _sample(self, prompts, fields):
    last = None  # the exception line the server died of last time
    for restart in range(self.max_restarts + 1):
      try:
        return self._sample_once(prompts, fields)
      except ServerDown as e:
        if self._server is None:
          raise VllmError(self._down_message(e)) from e
        cause = _exception_line(self._server.first_error() or "")
        again = bool(cause) and cause == last  # restarting again would die again
        if again or restart == self.max_restarts:
          raise VllmError(self._down_message(e, again=again)) from e
        last = cause
        log.warning("vLLM server stopped answering (%s); restarting it and requesting the batch again; %s",
                    e, self._server.failure())
        self._restart(self._weights_path)

  def _sample_once(self, prompts, fields):
    futures = [self._pool.submit(self.client.complete, p, f) for p, f in zip(prompts, fields)]
    cf.wait(futures)  # every request has ended before anything is raised or retried
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
      raise next((e for e in errors if not isinstance(e, ServerDown)), errors[0])
    return [f.result() for f in futures]

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
    super().close()
    if self._owns_server:
      self._server.stop()


_EXCEPTION = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.*?)(?=\(\w+ pid=\d+\)|$)", re.M)


def _exception_line(block: str) -> str:
  """The exception a server died of ('RuntimeError: ...'), robust to log lines that processes
  writing at once ran together."""
  found = _EXCEPTION.findall(block)
  return f"{found[-1][0]}: {found[-1][1].strip()}" if found else ""


def _fits_in_shm(model_dir: str) -> bool:
  """/dev/shm holds two exports of the model folder's size (the new one and the one vLLM still reads)."""
  if not os.access("/dev/shm", os.W_OK) or not os.path.isdir(model_dir):
    return False
  size = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
             if os.path.isfile(os.path.join(model_dir, f)))
  return shutil.disk_usage("/dev/shm").free > 3 * size
