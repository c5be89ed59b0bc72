"""The mesh, the partition rules and the sharded trainer and engine (opdjax.parallel).

This process has one CPU device; checks that need several run in a subprocess with
JAX_NUM_CPU_DEVICES=4, as one process with four devices or as two processes with two each
(tests/test_multiprocess.py).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import free_port
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from opdjax.config.loader import ConfigError
from opdjax.config.schema import Config, MeshConfig, build
from opdjax.errors import UserError
from opdjax.models import Model
from opdjax.models.config import ModelConfig
from opdjax.parallel import mesh as M
from opdjax.parallel import rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_LIKE = ModelConfig(model_type="qwen3", vocab_size=1024, hidden_size=64, intermediate_size=192, num_layers=3,
                         num_heads=8, num_kv_heads=4, head_dim=16, qk_norm=True, tie_word_embeddings=False)


def _abstract(mc: ModelConfig):
  return jax.eval_shape(Model(mc).init, jax.random.key(0))


def _mesh(data=1, fsdp=1, tensor=1):
  return AbstractMesh((data, fsdp, tensor), M.AXES)


def test_rules_first_match_wins_and_layer_axis_stays_whole():
  specs = rules.param_specs(_abstract(QWEN3_LIKE), _mesh(2, 4, 2))
  layers = specs["layers"]
  assert layers["self_attn"]["q_proj"]["kernel"] == P(None, "fsdp", "tensor")  # heads on tensor
  assert layers["self_attn"]["k_proj"]["kernel"] == P(None, "fsdp", "tensor")
  assert layers["self_attn"]["o_proj"]["kernel"] == P(None, "tensor", "fsdp")
  assert layers["mlp"]["up_proj"]["kernel"] == P(None, "fsdp", "tensor")  # MLP hidden on tensor
  assert layers["mlp"]["down_proj"]["kernel"] == P(None, "tensor", "fsdp")
  assert specs["embed_tokens"]["embedding"] == P("fsdp", None)
  assert specs["lm_head"]["kernel"] == P(None, "fsdp")
  assert specs["norm"]["weight"] == P("fsdp")  # the catch-all
  # The stacked [L] axis is never sharded: the layer scan slices it.
  assert all(s[0] is None for s in jax.tree.leaves(layers, is_leaf=lambda x: isinstance(x, P)))
  assert rules.param_path(("layers", "mlp", "down_proj", "kernel")) == "layers.*.mlp.down_proj.kernel"
  assert rules.rule_for("layers.*.self_attn.q_proj.kernel") == P("fsdp", "tensor")  # before the catch-all


def test_fsdp_moves_to_the_largest_dim_it_divides_or_replicates():
  # fsdp=3 divides neither D=64 nor E=16 but the MLP hidden (192): the first dim it divides, else nothing.
  specs = rules.param_specs(_abstract(QWEN3_LIKE), _mesh(1, 3, 1))
  assert specs["layers"]["mlp"]["up_proj"]["kernel"] == P(None, None, "fsdp")
  assert specs["layers"]["self_attn"]["q_proj"]["kernel"] == P(None, None, None)
  assert specs["embed_tokens"]["embedding"] == P(None, None)  # 1024 and 64: neither divides by 3
  with pytest.raises(UserError, match=r"tensor=3 does not divide dim 2 \(64\) of layers.\*.self_attn.k_proj.kernel"):
    rules.param_specs(_abstract(QWEN3_LIKE), _mesh(1, 1, 3))


def test_optimizer_state_mirrors_the_params():
  from opdjax.training.step import OptimConfig, TrainState, make_optimizer

  params = _abstract(QWEN3_LIKE)
  state = jax.eval_shape(lambda p: TrainState.create(p, make_optimizer(OptimConfig())), params)
  sh = rules.mirrored_shardings(state, state.params, _mesh(1, 4, 2))
  mu = sh.opt_state[1][0].mu
  assert mu["layers"]["mlp"]["down_proj"]["kernel"].spec == P(None, "tensor", "fsdp")
  assert sh.params["embed_tokens"]["embedding"].spec == P("fsdp", None)
  assert sh.step.spec == P() and sh.opt_state[1][0].count.spec == P()  # counters: replicated


def test_mesh_sizes_name_the_numbers():
  assert M.axis_sizes(MeshConfig(fsdp=-1), 8) == (1, 8, 1)
  assert M.axis_sizes(MeshConfig(data=2, fsdp=-1, tensor=2), 16) == (2, 4, 2)
  with pytest.raises(UserError, match="mesh data=1xfsdp=3xtensor=1 covers 3 devices but there are 4"):
    M.axis_sizes(MeshConfig(fsdp=3), 4)
  with pytest.raises(UserError, match=r"the fixed axes \(3 devices\) do not divide the 4 devices"):
    M.axis_sizes(MeshConfig(data=3, fsdp=-1), 4)
  mesh = _mesh(2, 2, 4)
  with pytest.raises(UserError, match="mesh.tensor=4 does not divide the teacher's num_kv_heads=2"):
    M.check_fits(mesh, {"student": QWEN3_LIKE, "teacher": QWEN3_LIKE.replace(num_kv_heads=2)}, {})
  with pytest.raises(UserError, match="rollout.batch_size=6 is not a multiple of mesh.data x mesh.fsdp = 2 x 2 = 4"):
    M.check_fits(_mesh(2, 2, 1), {"student": QWEN3_LIKE}, {"rollout.batch_size": 6})
  M.check_fits(_mesh(2, 2, 2), {"student": QWEN3_LIKE}, {"rollout.batch_size": 8})  # fits: no error


def test_mesh_config_keys_are_checked():
  assert build(Config().to_dict() | {"mesh": {"data": 2, "fsdp": -1, "tensor": 1}}).mesh.fsdp == -1
  with pytest.raises(ConfigError, match="mesh.data=0: give a positive axis size, or -1"):
    build(Config().to_dict() | {"mesh": {"data": 0, "fsdp": 1, "tensor": 1}})
  with pytest.raises(ConfigError, match="mesh.data and mesh.fsdp are both -1"):
    build(Config().to_dict() | {"mesh": {"data": -1, "fsdp": -1, "tensor": 1}})
  # Asynchronous rollouts on a mesh: the JAX engine on devices of its own (tests/test_async_mesh.py).
  assert Config().replace(mesh={"fsdp": 2}, rollout={"async_depth": 1, "devices": "2,3"}).rollout.devices == "2,3"


def _run_4dev(code: str, timeout: int = 600) -> dict:
  """Runs `code` with four host CPU devices; it prints one JSON line last."""
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "PYTHONPATH": ROOT}
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


ENGINE_PARITY = """
import json, jax, jax.numpy as jnp, numpy as np
from opdjax.config.schema import MeshConfig
from opdjax.models import Model
from opdjax.models.config import ModelConfig
from opdjax.parallel.placement import Placement
from opdjax.parallel.mesh import make_mesh
from opdjax.rollout import JaxEngine, SamplingParams
from opdjax.training.step import OptimConfig, create_state, make_optimizer

assert jax.device_count() == 4
mc = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=False, eos_token_id=-1)
model = Model(mc)
params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape), model.init(jax.random.key(0)))
rng = np.random.default_rng(0)
prompts = [list(rng.integers(3, 64, size=int(rng.integers(2, 9)))) for _ in range(8)]
sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
out = {}
def run(placement):
  p = params if placement is None else placement.params(params)
  e = JaxEngine(model, p, max_len=32, pad_id=0, eos_ids=(), placement=placement)
  r = e.generate(prompts, sampling, seed=3)
  r2 = e.generate(prompts, sampling, seed=4)  # the donated, sharded cache is reused
  return r, r2, e, p
base, base2, _, _ = run(None)
for name, cfg in {"fsdp4": MeshConfig(fsdp=4), "data2_fsdp2": MeshConfig(data=2, fsdp=2),
                  "fsdp2_tensor2": MeshConfig(fsdp=2, tensor=2)}.items():
  pl = Placement(make_mesh(cfg))
  r, r2, e, p = run(pl)
  state = create_state(pl, p, make_optimizer(OptimConfig()))
  mu = state.opt_state[1][0].mu["layers"]["mlp"]["up_proj"]["kernel"]
  out[name] = {
    "tokens_equal": bool(np.array_equal(r.completion_tokens, base.completion_tokens)
                         and np.array_equal(r2.completion_tokens, base2.completion_tokens)),
    "mask_equal": bool(np.array_equal(r.completion_mask, base.completion_mask)),
    "lp_diff": float(max(np.abs(np.asarray(r.rollout_logprobs) - np.asarray(base.rollout_logprobs)).max(),
                         np.abs(np.asarray(r2.rollout_logprobs) - np.asarray(base2.rollout_logprobs)).max())),
    "token_devices": len(r.completion_tokens.sharding.device_set),
    "token_rows_per_device": r.completion_tokens.addressable_shards[0].data.shape[0],
    "cache_spec": str(e._cache["layers"][0]["k"].sharding.spec),
    "kernel_shard": list(p["layers"]["mlp"]["up_proj"]["kernel"].addressable_shards[0].data.shape),
    "mu_shard": list(mu.addressable_shards[0].data.shape), "mu_shape": list(mu.shape),
  }
out["base_tokens_vary"] = int(len(np.unique(np.asarray(base.completion_tokens))))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sharded_engine_samples_the_single_device_tokens():
  out = _run_4dev(ENGINE_PARITY)
  assert out["base_tokens_vary"] > 10  # real sampling at T = 1, not a constant stream
  for name, r in ((k, v) for k, v in out.items() if isinstance(v, dict)):
    assert r["tokens_equal"] and r["mask_equal"], name
    assert r["lp_diff"] < 1e-5, (name, r["lp_diff"])
    assert r["token_devices"] == 4, name
    # The parity is not trivial: rows, weights, KV cache and optimizer moments really are split.
    assert r["token_rows_per_device"] == {"fsdp4": 2, "data2_fsdp2": 2, "fsdp2_tensor2": 4}[name], name
    assert r["mu_shard"] != r["mu_shape"] and r["kernel_shard"] != [2, 32, 64], name
  assert out["fsdp4"]["cache_spec"] == "P(('data', 'fsdp'), 'tensor', None, None)"  # each layer's [B, K, S, E]
  assert out["fsdp2_tensor2"]["kernel_shard"] == [2, 16, 32]  # [L, D/fsdp, F/tensor]


# --- the CLI on 1 device vs 1 process x 4 devices ---

STEPS = 5
# A quarter of the demo's batch (16: a multiple of every mesh here) and 16 held-out prompts (of 256): the
# runs compared are the same sizes on either side, so the parity checks do not depend on them. One 8-step
# learning-rate schedule for every run (5, 8 steps), so that the extended runs below continue the schedule their
# checkpoint started. (It was chosen, 2026-12-07, while the schedule was a constant of the compiled step and each
# run length compiled its own programs; the schedule is optimizer state now and every length shares them.)
TRAIN = ["train", "--config", "configs/demo.py", f"--config.train.steps={STEPS}", "--config.task.num_eval=16",
         "--config.rollout.batch_size=16", "--config.optim.total_steps=8"]


def cli_train(out, *extra, devices: int = 1, env=None, timeout: int = 900, **popen):
  """`opdjax train` in a subprocess with `devices` host CPU devices."""
  extra_env = env or {}
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": str(devices), **extra_env}
  if "OPDJAX_FAULT" not in extra_env:
    env.pop("OPDJAX_FAULT", None)
  cmd = [sys.executable, "-m", "opdjax.cli", *TRAIN, "--out", str(out), *extra]
  if popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def losses(out) -> dict[int, float]:
  recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  return {r["step"]: r["loss"] for r in recs if "loss" in r}


def student(out) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  return load_file(os.path.join(out, "student", "model.safetensors"))


def assert_same_run(a, b, rel=1e-5, atol=1e-5):
  la, lb = losses(a), losses(b)
  assert sorted(la) == sorted(lb) == list(range(1, len(la) + 1))
  for s in la:
    assert abs(la[s] - lb[s]) <= rel * abs(la[s]), (s, la[s], lb[s])
  pa, pb = student(a), student(b)
  assert pa.keys() == pb.keys()
  assert max(float(np.abs(pa[k] - pb[k]).max()) for k in pa) <= atol


CKPT = ["--config.train.checkpoint_every=2"]


@pytest.fixture(scope="session")
def single_device_run(demo_cache, tmp_path_factory):
  out = tmp_path_factory.mktemp("single") / "run"
  p = cli_train(out, *CKPT)
  assert p.returncode == 0, p.stderr[-3000:]
  return out


@pytest.fixture(scope="session")
def four_device_run(single_device_run, tmp_path_factory):
  """1 process x 4 devices, mesh.fsdp=4 (after the single-device run has built the demo models)."""
  out = tmp_path_factory.mktemp("four") / "run"
  p = cli_train(out, *CKPT, "--config.mesh.fsdp=4", devices=4)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "mesh data=1 fsdp=4 tensor=1 over 4 devices (1 process(es) x 4 cpu)" in p.stderr  # really sharded
  return out


@pytest.mark.slow
def test_fsdp_training_matches_one_device(single_device_run, four_device_run):
  assert_same_run(single_device_run, four_device_run)
  assert len(losses(four_device_run)) == STEPS


@pytest.mark.slow
def test_data_and_fsdp_training_matches_one_device(single_device_run, tmp_path):
  out = tmp_path / "run"
  p = cli_train(out, *CKPT, "--config.mesh.data=2", "--config.mesh.fsdp=2", devices=4)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "mesh data=2 fsdp=2 tensor=1 over 4 devices" in p.stderr
  assert_same_run(single_device_run, out)


# --- two processes x two devices on localhost (jax.distributed, gloo) ---

class Procs:
  """`opdjax train` as processes 0..n-1 of one run, output to files; every child is killed at the end."""

  def __init__(self, tmp, out, *extra, n: int = 2, fault: str | None = None, args_of=None):
    port = free_port()
    self.logs = [tmp / f"proc{i}.log" for i in range(n)]
    self.procs = []
    for i in range(n):
      env = {"PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "2", **({"OPDJAX_FAULT": fault} if fault and i == 1 else {})}
      args = [*extra, *(args_of(i) if args_of else ()), "--coordinator", f"127.0.0.1:{port}", "--num-processes",
              str(n), "--process-id", str(i)]
      full_env = {k: v for k, v in os.environ.items() if k != "OPDJAX_FAULT"} | env
      with open(self.logs[i], "w") as log:
        self.procs.append(subprocess.Popen([sys.executable, "-m", "opdjax.cli", *TRAIN, "--out", str(out), *args],
                                           cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT))

  def wait(self, timeout: float) -> list[tuple[int, float]]:
    """(return code, time it ended) of each process; kills them all after `timeout` seconds."""
    deadline, ended = time.time() + timeout, {}
    while len(ended) < len(self.procs) and time.time() < deadline:
      for i, p in enumerate(self.procs):
        if i not in ended and p.poll() is not None:
          ended[i] = (p.returncode, time.time())
      time.sleep(0.2)
    self.kill()
    assert len(ended) == len(self.procs), f"processes {sorted(set(range(len(self.procs))) - set(ended))} hung"
    return [ended[i] for i in range(len(self.procs))]

  def log(self, i: int) -> str:
    return self.logs[i].read_text()

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture(scope="session")
def two_process_run(four_device_run, tmp_path_factory):
  tmp = tmp_path_factory.mktemp("two")
  procs = Procs(tmp, tmp / "run", *CKPT, "--config.mesh.fsdp=4")
  (rc0, _), (rc1, _) = procs.wait(900)
  assert rc0 == 0 and rc1 == 0, procs.log(0)[-3000:] + procs.log(1)[-3000:]
  assert "over 4 devices (2 process(es) x 2 cpu)" in procs.log(0)
  return tmp / "run", procs


@pytest.mark.slow
def test_two_processes_match_one_process(single_device_run, four_device_run, two_process_run):
  out, procs = two_process_run
  assert_same_run(four_device_run, out)
  assert_same_run(single_device_run, out)
  # Process 0 alone writes: every step once in metrics.jsonl, progress only in its log.
  assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == list(range(STEPS + 1))
  assert "OPD: step" in procs.log(0) and "OPD: step" not in procs.log(1)


@pytest.mark.slow
def test_a_second_start_of_a_multi_process_run_compiles_nothing(two_process_run, tmp_path, monkeypatch):
  """The same 2-process run started again finds every program in the persistent compilation cache, on
  process 1 too: JAX writes that cache from process 0 only, and process 1's own-device programs (the engine's
  rollouts, the scoring of its rows) have keys process 0 never writes, so before opdjax let every process write
  (opdjax.pipeline.distributed.cache_on_every_process) process 1 missed 89 programs at every start."""
  first, _ = two_process_run
  monkeypatch.setenv("JAX_EXPLAIN_CACHE_MISSES", "true")  # JAX logs each persistent-cache miss
  procs = Procs(tmp_path, tmp_path / "run", *CKPT, "--config.mesh.fsdp=4")
  assert [rc for rc, _ in procs.wait(900)] == [0, 0], procs.log(0)[-3000:] + procs.log(1)[-3000:]
  for i in range(2):
    assert "PERSISTENT COMPILATION CACHE MISS" not in procs.log(i), (i, procs.log(i)[-3000:])
  assert "TRACING CACHE MISS" in procs.log(1)  # the logging was on: a traced program is looked up, then found
  assert losses(tmp_path / "run") == losses(first)  # the cached executables: the first start's losses, bit for bit


def _same_files(a, b):
  assert (a / "student" / "model.safetensors").read_bytes() == (b / "student" / "model.safetensors").read_bytes()
  ra = [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in open(a / "metrics.jsonl")]
  rb = [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in open(b / "metrics.jsonl")]
  assert ra == rb


@pytest.mark.slow
def test_two_process_checkpoint_resumes_in_one_process(two_process_run, tmp_path):
  from opdjax.models.config import ModelConfig
  from opdjax.models.hf_io import to_hf
  from opdjax.pipeline.export import restore_student

  out, _ = two_process_run
  # Restored on this process's one device, the 2 x 2-device run's final state is the one it exported.
  _, params, meta = restore_student(str(out))
  assert meta["step"] == STEPS
  exported = student(out)
  restored = to_hf(params, ModelConfig.from_hf_dict(meta["student_config"]))
  assert all(np.array_equal(restored[k], exported[k]) for k in exported)
  # Extended by one process x 4 devices: killed partway and resumed from its last complete checkpoint, it
  # ends as an uninterrupted one-process continuation of the 2-process checkpoint does, bit for bit.
  more = [*CKPT, f"--config.train.steps={STEPS + 3}", "--config.mesh.fsdp=4"]
  a, b = tmp_path / "a", tmp_path / "b"
  shutil.copytree(out, a)
  shutil.copytree(out, b)
  killed = cli_train(a, *more, devices=4, env={"OPDJAX_FAULT": f"step@{STEPS + 3}"})
  assert killed.returncode == -9, killed.stderr[-2000:]
  done = max(int(d) for d in os.listdir(a / "checkpoints" / "latest") if d.isdigit())
  resumed = {run: cli_train(run, *more, devices=4) for run in (a, b)}
  for p in resumed.values():
    assert p.returncode == 0, p.stderr[-3000:]
  assert f"resumed at step {done}, ran to step {STEPS + 3}" in resumed[a].stdout
  assert f"resumed at step {STEPS}, ran to step {STEPS + 3}" in resumed[b].stdout
  _same_files(a, b)
  assert [json.loads(line)["step"] for line in open(a / "metrics.jsonl")] == list(range(STEPS + 4))


@pytest.mark.slow
def test_a_killed_process_stops_the_other_and_the_last_checkpoint_restores(demo_cache, two_process_run, tmp_path):
  """The run of `two_process_run` (its compiled programs: the same layout and schedule) with a checkpoint at every
  step, process 1 SIGKILLed after dispatching step 4; resumed by one process x 4 devices. Both starts load their
  programs from the persistent cache: 24 CPU-s, against 48 when this was a 6-step run that compiled its own
  (measured 2026-12-07)."""
  out = tmp_path / "run"
  procs = Procs(tmp_path, out, "--config.train.checkpoint_every=1", "--config.mesh.fsdp=4", fault="step@4")
  (rc0, _), (rc1, _) = procs.wait(900)
  assert rc1 == -9  # SIGKILLed after dispatching step 4
  assert rc0 == 3, (rc0, procs.log(0)[-3000:])
  # No hang: the watchdog saw process 1's connection drop (the kernel closes it at the SIGKILL) and
  # stopped process 0, rather than a collective waiting for process 1 until some timeout.
  assert (f"opdjax: error: process 1 of 2 on host {socket.gethostname()} stopped; this process (process 0) stops too"
          " instead of waiting for it" in procs.log(0)), procs.log(0)[-3000:]
  done = sorted(int(d) for d in os.listdir(out / "checkpoints" / "latest") if d.isdigit())
  assert done and done[-1] < 4
  p = cli_train(out, "--config.train.checkpoint_every=1", "--config.mesh.fsdp=4", devices=4)
  assert p.returncode == 0, p.stderr[-3000:]
  assert f"resumed at step {done[-1]}, ran to step {STEPS}" in p.stdout
  assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == list(range(STEPS + 1))


@pytest.mark.slow
def test_processes_with_different_configs_name_the_key(tmp_path):
  procs = Procs(tmp_path, tmp_path / "run", "--config.mesh.fsdp=4",
                args_of=lambda i: [f"--config.optim.learning_rate={0.001 * (i + 1)}"])
  for i, (rc, _) in enumerate(procs.wait(300)):
    assert rc == 2, procs.log(i)[-2000:]
    assert "config key optim.learning_rate differs across processes" in procs.log(i)
  assert not (tmp_path / "run").exists()  # nothing written


def test_unreachable_coordinator_is_one_clear_error_after_a_bounded_wait(tmp_path):
  p = cli_train(tmp_path / "run", "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
                "--process-id", "1", "--coordinator-timeout", "3", devices=2, timeout=120)
  assert p.returncode == 3, p.stderr[-2000:]
  # The bounded wait is opdjax's own, of the 3 s asked for: not JAX's initialization timeout (60 s
  # later, an abort with a stack trace) and not the subprocess timeout above.
  assert "could not join the 2 processes through the coordinator at 127.0.0.1" in p.stderr
  assert "within 3 s (this is process 1)" in p.stderr, p.stderr[-2000:]
  assert "Nothing answers there" in p.stderr and "Check failure" not in p.stderr


def test_every_process_writes_the_compilation_cache_through_jaxs_writer_as_it_is():
  """cache_on_every_process replaces JAX's private writer only where it has the shape read in JAX 0.10: a JAX
  that changes it turns the replacement off, and this test says so rather than every other process compiling
  again at each start unnoticed. One process (process 0) keeps JAX's writer."""
  import inspect

  from jax._src import compiler

  from opdjax.pipeline import distributed

  assert list(inspect.signature(compiler._cache_write).parameters) == distributed._CACHE_WRITE_ARGS  # noqa: SLF001
  assert distributed.cache_on_every_process() is False and not hasattr(compiler._cache_write, "opdjax_every_process")


def test_multiprocess_flags_go_together(capsys):
  from opdjax import cli

  assert cli.main([*TRAIN, "--out", "x", "--coordinator", "127.0.0.1:1234"]) == 2
  assert "--coordinator HOST:PORT, --num-processes N and --process-id I go together" in capsys.readouterr().err


def test_scheduler_detection_needs_several_tasks(monkeypatch):
  from opdjax.pipeline import distributed

  for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
    monkeypatch.delenv(var, raising=False)
  assert distributed.detected_tasks() == 1
  assert distributed.initialize() is False  # no flags, no scheduler: one process, nothing started
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert distributed.initialize() is False  # a one-task SLURM job (launch/slurm_opd.sh) stays single-process
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
  monkeypatch.delenv("SLURM_NTASKS")
  assert distributed.detected_tasks() == 4
  with pytest.raises(UserError, match="--process-id 2 with --num-processes 2"):
    distributed.initialize("127.0.0.1:1", 2, 2)


PRIMARY_ENGINE = """
import hashlib, json, sys
import jax, numpy as np
from opdjax.pipeline import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=120)
from opdjax.config.schema import MeshConfig
from opdjax.models import Model
from opdjax.models.config import ModelConfig
from opdjax.parallel.mesh import make_mesh
from opdjax.parallel.placement import Placement
from opdjax.rollout.vllm.primary import PrimaryEngine
from opdjax.rollout import JaxEngine, SamplingParams

mc = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=False, eos_token_id=-1)
model = Model(mc)
params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape), model.init(jax.random.key(0)))
place = Placement(make_mesh(MeshConfig(fsdp=-1)))
sharded = place.params(params)  # the trainer's params: global arrays over both processes
prompts = [[3 + (7 * i) % 50, 5, 9 + i] for i in range(8)]
sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
engine = PrimaryEngine(lambda: JaxEngine(model, None, max_len=32, pad_id=0, eos_ids=()), place,
                       JaxEngine.capabilities, pad_id=0)
engine.sync(sharded, 3)
r = engine.generate(prompts, sampling, seed=11)
whole = place.host(r.completion_tokens)  # every process's rows, gathered (a collective: every process)
whole_lp = place.host(r.rollout_logprobs)
out = {"rows_here": int(sum(s.data.shape[0] for s in r.completion_tokens.addressable_shards)),
       "devices": len(r.completion_tokens.sharding.device_set), "version": r.params_version,
       "digest": hashlib.sha256(np.ascontiguousarray(whole).tobytes()).hexdigest(),
       "varied": int(len(np.unique(whole)))}
if engine.inner is not None:  # process 0: what its engine sampled, unsharded
  ref = JaxEngine(model, jax.tree.map(np.asarray, params), max_len=32, pad_id=0, eos_ids=()).generate(
      prompts, sampling, seed=11)
  out["equal_to_direct"] = bool(np.array_equal(whole, np.asarray(ref.completion_tokens)))
  out["lp_diff"] = float(np.abs(whole_lp - np.asarray(ref.rollout_logprobs)).max())
distributed.finish()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_engine_in_process_0_serves_every_process(tmp_path):
  """vLLM sidecars behind a 2-process trainer: process 0 samples, each process keeps its own rows."""
  port = free_port()
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "2"}
  logs = [tmp_path / f"p{i}.log" for i in range(2)]
  procs = []
  for i in range(2):
    with open(logs[i], "w") as f:
      procs.append(subprocess.Popen([sys.executable, "-c", PRIMARY_ENGINE, f"127.0.0.1:{port}", str(i)], cwd=ROOT,
                                    env=env, stdout=f, stderr=subprocess.STDOUT))
  try:
    for p in procs:
      p.wait(timeout=300)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], logs[0].read_text()[-2000:] + logs[1].read_text()[-2000:]
  a, b = (json.loads(log.read_text().strip().splitlines()[-1]) for log in logs)
  assert a["equal_to_direct"] and a["lp_diff"] == 0.0 and a["varied"] > 5
  assert a["digest"] == b["digest"]  # both processes hold parts of one rollout
  assert a["rows_here"] == b["rows_here"] == 4 and a["devices"] == 4  # 8 rows: each process holds its half
  assert a["version"] == b["version"] == 3
