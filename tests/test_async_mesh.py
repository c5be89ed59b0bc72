"""One host, two meshes: the trainer sharded over some of the host's devices, the asynchronous JAX
engine on the others as its own mesh (opdjax.parallel.devices, opdjax.pipeline.async_sampler).

This process has one CPU device; the checks run in a subprocess with JAX_NUM_CPU_DEVICES=4.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("time_", "idle_", "overlap_", "busy_", "wall_s", "elapsed_s", "async_depth", "params_lag_max")


def _run_4dev(code: str, *args: str, timeout: int = 900) -> dict:
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "PYTHONPATH": ROOT}
  env.pop("OPDJAX_FAULT", None)
  p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=timeout)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


TWO_MESHES = r"""
import json, sys, time
import jax
from opdjax.config.schema import Config
from opdjax.pipeline.loop import Hook, run_loop
from opdjax.pipeline.session import Session
from opdjax.views.view import EngineView

assert jax.device_count() == 4, jax.devices()
cfg = Config().replace(task={"num_eval": 16}, rollout={"batch_size": 16, "async_depth": 1, "devices": "2,3"},
                       mesh={"fsdp": 2})
s = Session(cfg, None, progress=False)  # the trainer's mesh: devices 0, 1 (what rollout.devices leaves)
timing = tuple(json.loads(sys.argv[1]))
strip = lambda r: {k: v for k, v in r.items() if not k.startswith(timing)}
lagged = run_loop(s, view=EngineView(lag=1), steps=6).records  # synchronous lag=1 on the trainer's 2-device mesh
fresh = run_loop(s, steps=6).records
loop = run_loop(s, steps=6, async_depth=1, devices="2,3")

class Sleep(Hook):
  def after_step(self, loop, step):
    time.sleep(0.2)

bounded = run_loop(s, steps=8, hooks=[Sleep()], async_depth=2, async_mode="bounded", devices="2,3").records
ids = lambda x: sorted(d.id for d in x.sharding.device_set)
emb = loop.sampler.engine._params["embed"]
kernel = loop.sampler.engine._params["layers"][0]["gate_up"]
print(json.dumps({
    "exact_equal": [strip(r) for r in loop.records] == [strip(r) for r in lagged],
    "n": len(loop.records), "lags": [r["params_lag"] for r in loop.records],
    "fresh_differs": fresh[-1]["loss"] != loop.records[-1]["loss"],
    "engine_params": ids(emb), "engine_kernel_shard": list(kernel.addressable_shards[0].data.shape),
    "kernel_shape": list(kernel.shape), "engine_cache": ids(loop.sampler.engine._cache["layers"][0]["k"]),
    "trainer_params": ids(loop.state.params["embed_tokens"]["embedding"]),
    "engine_mesh": dict(loop.sampler.side.placement.mesh.shape),
    "bounded_steps": [r["step"] for r in bounded], "bounded_lags": [r["params_lag"] for r in bounded],
    "bounded_versions": [r["params_version"] for r in bounded],
}))
"""


@pytest.mark.slow
def test_exact_on_two_meshes_is_the_lag_run_bitwise_and_bounded_keeps_its_bound(demo_cache):
  """Trainer fsdp=2 on devices {0, 1}, JAX engine fsdp=2 on {2, 3}: exact async_depth=1 equals the
  synchronous lag=1 run on the 2-device mesh in every record field; bounded depth 2 never goes past
  a lag of 2."""
  out = _run_4dev(TWO_MESHES, json.dumps(TIMING))
  assert out["exact_equal"] and out["n"] == 6, out
  assert out["lags"] == [0, 1, 1, 1, 1, 1]
  assert out["fresh_differs"]  # the staleness really changes the run: the parity is not trivial
  # Really two meshes: the engine's weights and KV cache on devices 2, 3 (sharded), the trainer's on 0, 1.
  assert out["engine_params"] == out["engine_cache"] == [2, 3] and out["trainer_params"] == [0, 1]
  assert out["engine_kernel_shard"] != out["kernel_shape"]
  assert out["engine_mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
  assert out["bounded_steps"] == list(range(1, 9))
  assert all(0 <= lag <= 2 for lag in out["bounded_lags"]), out["bounded_lags"]
  assert out["bounded_versions"] == sorted(out["bounded_versions"])
  assert 2 in out["bounded_lags"][2:]  # a slow trainer: the producer runs ahead to the bound


BAD = r"""
import contextlib, io, json, os, sys
from opdjax import cli
from opdjax.rollout import deploy

base = ["train", "--config", "configs/demo.py", "--config.rollout.async_depth=1", "--config.train.steps=1",
        "--config.rollout.batch_size=16", "--config.task.num_eval=16"]
cases = {
    "overlap": ["--config.mesh.fsdp=4", "--config.rollout.devices=2,3"],
    "overlap_default_mesh": ["--config.rollout.devices=0,1"],
    "empty": ["--config.mesh.fsdp=-1", "--config.rollout.devices=4"],
    "empty_set": ["--config.mesh.fsdp=-1", "--config.rollout.devices=0,1,2,3"],
    "lacks": ["--config.mesh.fsdp=2", "--config.rollout.devices=4,5"],
    "no_devices": ["--config.mesh.fsdp=2"],
    "memory": ["--config.mesh.fsdp=2", "--config.rollout.devices=2,3"],
}
out = {}
for name, extra in cases.items():
  if name == "memory":
    deploy.free_bytes = lambda device: 1000  # engine devices with 1000 bytes free
  path = os.path.join(sys.argv[1], name)
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    rc = cli.main([*base, "--out", path, *extra])
  out[name] = {"rc": rc, "err": err.getvalue(), "written": os.path.exists(path)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_engine_devices_the_layout_cannot_use_are_one_error_each_before_anything_is_written(demo_cache, tmp_path):
  out = _run_4dev(BAD, str(tmp_path))
  want = {
      "overlap": "rollout.devices='2,3' overlaps the trainer's mesh: the JAX engine takes devices 2,3 of this host's"
                 " 4, the trainer's mesh is built over the 2 left (0,1), and mesh data=1xfsdp=4xtensor=1 covers 4."
                 " Make the mesh cover 2 devices",
      "overlap_default_mesh": "rollout.devices='0,1' overlaps the trainer: the one-device trainer (the default mesh)"
                              " trains on device 0",
      "empty": "gives the JAX engine every one of this host's 4 devices and leaves the trainer none",
      "empty_set": "gives the JAX engine every one of this host's 4 devices and leaves the trainer none",
      "lacks": "rollout.devices='4,5' names device(s) 4, 5, which this host lacks: it has 4 cpu device(s)",
      "no_devices": "give the engine its own devices with rollout.devices",
      "memory": "rollout.async_depth=1 keeps 3 params copies",
  }
  for name, match in want.items():
    r = out[name]
    assert r["rc"] == 2 and match in r["err"] and r["err"].count("error") == 1, (name, r["err"][-2000:])
    assert not r["written"], name  # nothing written before the error


def test_rollout_devices_is_a_count_or_a_set():
  from opdjax.config.defaults import default_config
  from opdjax.config.loader import ConfigError, apply_overrides
  from opdjax.config.schema import build
  from opdjax.parallel.devices import parse

  assert parse("2") == ("count", (2,)) and parse("2,3") == ("set", (2, 3)) and parse("3,") == ("set", (3,))
  for bad, match in (("x", "give a count"), ("2,2", "distinct device indices"), (",", "distinct device indices")):
    with pytest.raises(ConfigError, match=match):
      build(apply_overrides(default_config(), {"rollout.async_depth": "1", "rollout.devices": bad}))


ADVICE = r"""
import jax
from opdjax.errors import UserError
from opdjax.parallel.devices import engine_devices
print(len(jax.local_devices()), len(engine_devices("9")))
try:
  engine_devices("12")
except UserError as e:
  print(e)
"""


def test_a_count_the_host_cannot_give_says_how_to_give_it_more_devices():
  """rollout.devices=9 on a one-device host said 'give a count from 1 to 0'. It says the host has too few, and
  how to give the process more; following that advice on CPU gives the engine its 9 devices."""
  import jax

  from opdjax.errors import UserError
  from opdjax.parallel.devices import engine_devices, more_devices

  with pytest.raises(UserError) as e:
    engine_devices("9", jax.local_devices()[:1])
  msg = str(e.value)
  assert "this host has 1 cpu device(s): too few" in msg and "from 1 to 0" not in msg, msg
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=10" in msg and "ask for fewer" not in msg, msg
  assert "CUDA_VISIBLE_DEVICES" in more_devices("gpu", 10) and "XLA_FLAGS" not in more_devices("gpu", 10)
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=10"}
  env.pop("JAX_NUM_CPU_DEVICES", None)
  res = subprocess.run([sys.executable, "-c", ADVICE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-2000:]
  first, error = res.stdout.strip().splitlines()
  assert first == "10 9"
  assert "has 10 cpu device(s): too few" in error and "ask for fewer (rollout.devices from 1 to 9)" in error, error


RESUME = ["--config", "configs/demo.py", "--config.task.num_eval=16", "--config.rollout.batch_size=16",
          "--config.train.steps=8", "--config.train.checkpoint_every=2", "--config.train.eval_every=2",
          "--config.mesh.fsdp=2"]


def _train(out, *args, devices: int, fault: str | None = None):
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "PYTHONPATH": ROOT}
  env.pop("OPDJAX_FAULT", None)
  if fault:
    env["OPDJAX_FAULT"] = fault
  return subprocess.run([sys.executable, "-m", "opdjax.cli", "train", "--out", str(out), *RESUME, *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=900)


def _records(out) -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["rollout@5"])
def test_two_meshes_sigkill_then_resume_is_the_uninterrupted_lag_run(demo_cache, tmp_path, fault):
  """The two-mesh layout SIGKILLed with a rollout in flight (the producer busy on devices 2, 3) and
  resumed from its checkpoint: its records and student are the uninterrupted synchronous lag=1 run's
  on a 2-device mesh, bitwise (the kept versions are checkpointed and copied back onto the engine)."""
  ref, out = tmp_path / "ref", tmp_path / "run"
  p = _train(ref, "--config.rollout.view=lag=1", devices=2)
  assert p.returncode == 0, p.stderr[-3000:]
  layout = ["--config.rollout.async_depth=1", "--config.rollout.devices=2,3"]
  killed = _train(out, *layout, devices=4, fault=fault)
  assert killed.returncode == -9, killed.stderr[-3000:]
  resumed = _train(out, *layout, devices=4)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed at step 4" in resumed.stdout or "resumed at step 2" in resumed.stdout, resumed.stdout
  assert (out / "student" / "model.safetensors").read_bytes() == (ref / "student" / "model.safetensors").read_bytes()
  strip = lambda r: {k: v for k, v in r.items() if not k.startswith(TIMING)}  # noqa: E731
  got, want = _records(out), _records(ref)
  assert [r["step"] for r in got] == list(range(9))  # every step exactly once
  assert [strip(r) for r in got] == [strip(r) for r in want]
