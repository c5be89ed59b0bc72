"""Asynchronous rollouts (opdjax.pipeline.async_sampler) and the runtime mismatch guard
(opdjax.pipeline.guards): depth 0 is the synchronous loop, exact mode is the lag view bitwise (one and
two host devices), bounded mode keeps its staleness bound, resume with rollouts in flight, start-up
errors, and the guard's warn / backoff / halt."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from opdjax import cli, seeds
from opdjax.config.defaults import default_config
from opdjax.config.loader import ConfigError, apply_overrides
from opdjax.config.schema import Config, build
from opdjax.errors import UserError
from opdjax.pipeline.guards import MismatchGuard
from opdjax.pipeline.hooks import EvalHook
from opdjax.pipeline.loop import Hook, run_loop
from opdjax.pipeline.session import Session
from opdjax.rollout import deploy
from opdjax.rollout.jax.cache import EngineCache
from opdjax.scoring.rescore import batch_from_rollout
from opdjax.training.step import TrainState
from opdjax.views.view import EngineView

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config", "configs/demo.py", "--config.task.num_eval=16", "--config.rollout.batch_size=16"]
TIMING = ("time_", "idle_", "overlap_", "busy_", "wall_s", "elapsed_s", "async_depth", "params_lag_max")


def _metrics(rec: dict) -> dict:
  """A record without what depends on timing or on the sampler kind."""
  return {k: v for k, v in rec.items() if not k.startswith(TIMING)}


def _records(out):
  return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _env(**extra):
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("OPDJAX_FAULT", None)
  return {**env, **extra}


@pytest.fixture(scope="module")
def session(demo_cache):
  s = Session(Config().replace(task={"num_eval": 16}, rollout={"batch_size": 16}), None, progress=False)
  yield s
  s.close()


def _view(spec: str, lag: int = 0) -> EngineView:
  return dataclasses.replace(EngineView.parse(spec), lag=lag)


# --- depth 0 and exact mode ----------------------------------------------------------------------

@pytest.mark.slow
def test_depth_zero_is_the_synchronous_loop_written_out(session):
  """async_depth=0 (timed or not) trains on the same rollouts as the loop written out by hand from
  the primitives: prompts and seeds by the seed rule, sample, re-score, one jitted step."""
  plain = run_loop(session, steps=4).records
  timed = run_loop(session, steps=4, timed=True).records
  step_fn, engine = session.train_step("opd"), session.engines.get(EngineView())
  state = TrainState.create(jax.tree.map(jnp.copy, session.student_params), session.optimizer())
  losses = []
  for t in range(4):
    prompts, _ = session.task.train_batch(seeds.rng(0, t, "prompts"), 16)
    engine.sync(state.params, t)
    rollout = engine.generate(prompts, session.sampling, seed=seeds.derive(0, t, "sample"))
    state, m = step_fn(state, session.teacher_params, batch_from_rollout(rollout))
    losses.append(float(m["loss"]))
  assert [r["loss"] for r in plain] == losses
  assert [_metrics(r) for r in timed] == [_metrics(r) for r in plain]
  assert "time_train_s" in timed[-1] and not any(k.startswith("time_") for k in plain[-1])
  assert len(set(losses)) == 4  # the steps really differ


@pytest.mark.slow
@pytest.mark.parametrize("spec,k", [("clean", 1), ("noise_sigma=0.05", 2)])
def test_exact_mode_equals_the_lag_view_bitwise(session, spec, k):
  """Same versions, noise draws (keyed by version), prompts and seeds as the synchronous lag=k view."""
  hooks = lambda: [EvalHook(3)]  # noqa: E731
  lagged = run_loop(session, view=_view(spec, k), steps=6, hooks=hooks()).records
  exact = run_loop(session, view=_view(spec), steps=6, hooks=hooks(), async_depth=k).records
  assert [_metrics(r) for r in exact] == [_metrics(r) for r in lagged]
  assert [r["params_lag"] for r in exact[1:]] == [min(t, k) for t in range(6)]
  assert all(r["params_lag_max"] == r["params_lag"] and r["async_depth"] == k for r in exact[1:])
  fresh = run_loop(session, view=_view(spec), steps=6).records
  assert fresh[-1]["loss"] != exact[-1]["loss"]  # the staleness really changes the run


TWO_DEVICES = r"""
import json, sys
import jax
from opdjax.config.schema import Config
from opdjax.pipeline.loop import run_loop
from opdjax.pipeline.session import Session
from opdjax.rollout import deploy
from opdjax.views.view import EngineView
assert jax.device_count() == 2, jax.devices()
s = Session(Config().replace(task={"num_eval": 16}, rollout={"batch_size": 16}), None, progress=False)
lagged = run_loop(s, view=EngineView(lag=1), steps=6).records
loop = run_loop(s, steps=6, async_depth=1)
timing = tuple(json.loads(sys.argv[1]))
strip = lambda r: {k: v for k, v in r.items() if not k.startswith(timing)}
assert [strip(r) for r in loop.records] == [strip(r) for r in lagged], "exact != lag=1"
assert loop.sampler.device == jax.devices()[1] and loop.sampler.trainer_device == jax.devices()[0]
assert loop.sampler.engine._params["embed"].devices() == {jax.devices()[1]}
assert loop.state.params["embed_tokens"]["embedding"].devices() == {jax.devices()[0]}
print(json.dumps({k: loop.records[-1][k] for k in ("time_generate_s", "time_train_s", "idle_trainer_frac")}))
print("ok")
"""


@pytest.mark.slow
def test_exact_mode_on_two_host_devices(tmp_path, demo_cache):
  """The producer samples on host device 1 while the trainer trains on device 0; still bitwise lag=1."""
  res = subprocess.run([sys.executable, "-c", TWO_DEVICES, json.dumps(TIMING)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=_env(JAX_NUM_CPU_DEVICES="2"))
  assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.slow
def test_train_cli_async_exact_writes_the_losses_of_the_lag_view(demo_cache, tmp_path):
  assert cli.main(["train", "--out", str(tmp_path / "a"), *SMALL, "--config.train.steps=5",
                   "--config.rollout.async_depth=1", "--config.rollout.async_mode=exact"]) == 0
  assert cli.main(["train", "--out", str(tmp_path / "b"), *SMALL, "--config.train.steps=5",
                   "--config.rollout.view=lag=1"]) == 0
  a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
  assert [r["loss"] for r in a[1:]] == [r["loss"] for r in b[1:]] and len(a) == 6
  assert all(r["time_generate_s"] > 0 and 0 <= r["idle_trainer_frac"] <= 1 for r in a[1:])


# --- bounded mode --------------------------------------------------------------------------------

class _Sleep(Hook):
  def __init__(self, seconds):
    self.seconds = seconds

  def after_step(self, loop, step):
    time.sleep(self.seconds)


@pytest.mark.slow
def test_bounded_mode_runs_free_within_the_depth(session, monkeypatch):
  """A slow trainer: the producer runs ahead to the bound (lag = k). A slow producer: it samples with
  the newest version (lag 1 < k). Never beyond k either way; every step once."""
  ahead = run_loop(session, steps=8, hooks=[_Sleep(0.2)], async_depth=2, async_mode="bounded").records
  engine_generate = EngineCache.get

  def slow_engine(self, model):
    engine = engine_generate(self, model)
    if not hasattr(engine, "_fast_generate"):
      engine._fast_generate = engine.generate
      engine.generate = lambda *a, **kw: (time.sleep(0.2), engine._fast_generate(*a, **kw))[1]
    return engine

  monkeypatch.setattr(EngineCache, "get", slow_engine)
  producer = session.deployment.engine_side(session.placement, session.student.cfg, "").key
  session.engines.drop(producer)  # a fresh producer engine, slowed
  behind = run_loop(session, steps=8, async_depth=2, async_mode="bounded").records
  session.engines.drop(producer)
  for recs in (ahead, behind):
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert all(0 <= r["params_lag"] <= 2 and r["params_version"] <= r["step"] - 1 for r in recs)
    assert [r["params_version"] for r in recs] == sorted(r["params_version"] for r in recs)
  assert [r["params_lag"] for r in ahead[3:]] == [2] * 5
  assert sum(r["params_lag"] == 1 for r in behind[1:]) >= 5


# --- resume with rollouts in flight -------------------------------------------------------------

RESUME = [*SMALL, "--config.train.steps=8", "--config.train.checkpoint_every=2", "--config.train.eval_every=2"]


def _subprocess_train(out, *args, fault=None):
  env = _env(**({"OPDJAX_FAULT": fault} if fault else {}))
  return subprocess.run([sys.executable, "-m", "opdjax.cli", "train", "--out", str(out), *RESUME, *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def lag_reference(demo_cache, tmp_path_factory):
  out = tmp_path_factory.mktemp("lagref") / "run"
  assert cli.main(["train", "--out", str(out), *RESUME, "--config.rollout.view=lag=1"]) == 0
  return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["step@3", "rollout@6"])
def test_exact_sigkill_then_resume_is_the_uninterrupted_lag_run(lag_reference, tmp_path, fault):
  """Killed with rollouts in flight (two host devices: the CLI makes the second), resumed: bitwise
  the synchronous lag=1 run that was never interrupted."""
  out = tmp_path / "run"
  killed = _subprocess_train(out, "--config.rollout.async_depth=1", fault=fault)
  assert killed.returncode == -9, killed.stderr[-2000:]
  resumed = _subprocess_train(out, "--config.rollout.async_depth=1")
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert (out / "student" / "model.safetensors").read_bytes() == \
      (lag_reference / "student" / "model.safetensors").read_bytes()
  got, want = _records(out), _records(lag_reference)
  assert [r["step"] for r in got] == list(range(9))  # every step exactly once
  assert [_metrics(r) for r in got] == [_metrics(r) for r in want]


@pytest.mark.slow
def test_bounded_sigkill_then_resume_loses_and_doubles_no_step(demo_cache, tmp_path):
  out = tmp_path / "run"
  args = ["--config.rollout.async_depth=2", "--config.rollout.async_mode=bounded"]
  assert _subprocess_train(out, *args, fault="step@5").returncode == -9
  resumed = _subprocess_train(out, *args)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  recs = _records(out)
  assert [r["step"] for r in recs] == list(range(9))
  assert all(0 <= r["params_lag"] <= 2 for r in recs[1:])
  versions = [r["params_version"] for r in recs[1:]]
  assert versions == sorted(versions)
  # The rollouts in flight at the checkpoint were sampled again, from the restored params.
  start = [json.loads(line) for line in open(out / "config_history.jsonl")][1]["start_step"]
  assert start in (2, 4) and recs[start + 1]["params_version"] == start


# --- start-up errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,match", [
    ("rollout.async_depth", "-1", "rollout.async_depth=-1: must be >= 0"),
    ("rollout.async_mode", "eventual", "rollout.async_mode='eventual'; choose one of 'exact', 'bounded'"),
    ("rollout.devices", "1", "set rollout.async_depth > 0"),
    ("train.guard", "halt", "train.guard='halt' needs train.budget=PATH"),
    ("train.budget", "/nonexistent/budget.json", "does not exist; write one with `opdjax calibrate"),
])
def test_bad_async_and_guard_keys_are_one_error_each(key, value, match):
  with pytest.raises(ConfigError, match=match.replace("(", r"\(")):
    build(apply_overrides(default_config(), {key: value}))


def test_view_lag_and_async_depth_together_are_refused():
  with pytest.raises(ConfigError, match="give the staleness once"):
    build(apply_overrides(default_config(), {"rollout.view": "lag=2", "rollout.async_depth": "1"}))


@pytest.mark.slow
def test_devices_the_engine_cannot_use_are_refused_at_start_up(session, monkeypatch):
  assert len(jax.local_devices()) == 1  # this test process: one CPU device, the trainer's
  with pytest.raises(UserError, match=r"rollout.devices='0,' overlaps the trainer's device .* devices of its own"):
    run_loop(session, steps=1, async_depth=1, devices="0,")
  with pytest.raises(UserError, match="names device.* 3, which this host lacks: it has 1 cpu.*JAX_NUM_CPU_DEVICES"):
    run_loop(session, steps=1, async_depth=1, devices="3,")
  with pytest.raises(UserError, match="asks for 2 device.*this host has 1 cpu device"):
    run_loop(session, steps=1, async_depth=1, devices="2")
  monkeypatch.setattr(deploy, "free_bytes", lambda device: 1000)  # a device with 1000 bytes free
  with pytest.raises(UserError, match="async_depth=3 keeps 5 params copies .* lower rollout.async_depth"):
    run_loop(session, steps=1, async_depth=3)


# --- the mismatch guard --------------------------------------------------------------------------

def _budget(tmp_path, value, student="", **rollout):
  from opdjax.pipeline.guards import BUDGET_FORMAT

  cfg = Config().to_dict()
  cfg["rollout"].update(rollout)
  path = tmp_path / f"budget-{value}-{student or 'ours'}-{len(rollout)}.json"
  path.write_text(json.dumps({"format": BUDGET_FORMAT, "budget": value, "student_fingerprint": student,
                              "scale": "token mean of exact KL(engine || trainer) on the calibration batch",
                              "config": cfg}))
  return str(path)


@pytest.fixture(scope="module")
def fingerprint(session):
  from opdjax.pipeline.guards import params_fingerprint

  return params_fingerprint(session.student_params)


@pytest.mark.slow
def test_budgets_that_do_not_fit_the_run_are_refused_before_anything_is_written(demo_cache, tmp_path, capsys,
                                                                                 fingerprint):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  cases = [(_budget(tmp_path, 0.01, student="0123456789abcdef"), "calibrated on another student"),
           (_budget(tmp_path, 0.01, student=fingerprint, temperature=0.7),
            "calibrated with rollout.temperature=0.7, this run samples with 1.0"),
           (str(bad), "is not valid JSON"),
           (_budget(tmp_path, -1.0, student=fingerprint), "not a KL >= 0")]
  for path, match in cases:
    out = tmp_path / "run"
    assert cli.main(["train", "--out", str(out), *SMALL, "--config.train.steps=1",
                     f"--config.train.budget={path}"]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("error") == 1, err
    assert not out.exists()


class _NoiseRamp:
  """Session.engine_params with the view's noise growing with the params version (0.05 per version),
  for views that have noise: the clean fallback view has none."""

  def __init__(self, session):
    self.inner = type(session).engine_params.__get__(session)

  def __call__(self, engine, view, params, version, seed):
    if view.noise_sigma > 0:
      view = dataclasses.replace(view, noise_sigma=view.noise_sigma + 0.05 * version)
    return self.inner(engine, view, params, version, seed)


@pytest.mark.slow
def test_noise_ramp_trips_the_guard_and_backoff_keeps_the_run_within_budget(session, monkeypatch):
  budget = 0.05
  monkeypatch.setattr(session, "engine_params", _NoiseRamp(session))
  guard = MismatchGuard(budget, "budget.json", "backoff", window=2, safer_view=EngineView())
  loop = run_loop(session, view=EngineView(noise_sigma=0.02), steps=20, hooks=[guard], async_depth=1)
  recs = loop.records
  events = [(r["step"], r["guard_event"]) for r in recs if "guard_event" in r]
  assert [e.split(": ", 1)[1] for _, e in events] == [
      "backoff: rollout.async_depth 1 -> 0", "backoff: rollout.view noise_sigma=0.02 -> clean"], events
  assert [r["step"] for r in recs] == list(range(1, 21))  # the run went on to the end
  last = events[-1][0]
  assert recs[last - 1]["guard_mismatch"] > budget
  after = [r for r in recs if r["step"] > last + 1]  # sampled after the last backoff took effect
  assert after and all(r["mismatch_kl_k3_tok"] < budget for r in after)
  assert all(r.get("guard_mismatch", 0) <= budget for r in after)
  assert loop.sampler.depth == 0 and loop.sampler.view == EngineView()


@pytest.mark.slow
def test_guard_halt_stops_with_a_checkpoint_of_the_step(demo_cache, tmp_path, capsys, fingerprint):
  path = _budget(tmp_path, 1e-4, student=fingerprint)
  out = tmp_path / "run"
  rc = cli.main(["train", "--out", str(out), *SMALL, "--config.train.steps=30", "--config.train.checkpoint_every=100",
                 "--config.rollout.view=noise_sigma=0.3", f"--config.train.budget={path}",
                 "--config.train.guard=halt", "--config.train.guard_window=2"])
  assert rc == 2
  err = capsys.readouterr().err
  recs = _records(out)
  tripped = next(r for r in recs if "guard_event" in r)
  assert tripped["guard_event"].endswith(": halt") and tripped["guard_mismatch"] > 1e-4
  assert f"at step {tripped['step']}, the live mismatch" in err and "exceeds the budget 0.0001" in err and path in err
  assert "guard: live mismatch" in err  # the progress line
  steps = sorted(int(s) for s in os.listdir(out / "checkpoints" / "latest") if s.isdigit())
  assert steps == [recs[-1]["step"]] and recs[-1]["step"] in (tripped["step"], tripped["step"] + 1)
  assert f"checkpointed at step {steps[-1]}" in err
