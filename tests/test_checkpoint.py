"""Orbax checkpoints: exact resume after SIGKILL, refusals that overwrite nothing, NaN handling."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from opdjax import cli
from opdjax.pipeline.checkpoint import RunCheckpointer

pytestmark = pytest.mark.slow  # end-to-end runs killed and resumed: the full suite runs them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A quarter of the demo's batch and 16 held-out prompts (of 256) evaluated every other step: what is
# checked (every step once, bitwise equal records and student) does not depend on the sizes.
SMALL = ["--config.task.num_eval=16", "--config.rollout.batch_size=16"]
ARGS = ["--config", "configs/demo.py", "--config.train.steps=8", "--config.train.checkpoint_every=2",
        "--config.train.eval_every=2", "--config.rollout.view=lag=1", *SMALL]


def _records(out):
  return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _subprocess_train(out, fault=None, args=ARGS):
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("OPDJAX_FAULT", None)
  if fault:
    env["OPDJAX_FAULT"] = fault
  return subprocess.run([sys.executable, "-m", "opdjax.cli", "train", "--out", str(out), *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(demo_cache, tmp_path_factory):
  out = tmp_path_factory.mktemp("ref") / "run"
  assert cli.main(["train", "--out", str(out), *ARGS]) == 0
  return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["step@3", "save@4", "rollout@7"])
def test_sigkill_then_resume_is_bitwise_identical(reference, tmp_path, fault):
  out = tmp_path / "run"
  killed = _subprocess_train(out, fault)
  assert killed.returncode == -9, killed.stderr[-2000:]
  resumed = _subprocess_train(out)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  ref = open(reference / "student" / "model.safetensors", "rb").read()
  assert open(out / "student" / "model.safetensors", "rb").read() == ref
  got, want = _records(out), _records(reference)
  assert [r["step"] for r in got] == list(range(9))  # every step exactly once
  for a, b in zip(got, want):
    assert {k: v for k, v in a.items() if k != "elapsed_s"} == {k: v for k, v in b.items() if k != "elapsed_s"}


@pytest.mark.slow
def test_resume_refusals_and_fallback(reference, tmp_path, capsys):
  out = tmp_path / "run"
  shutil.copytree(reference, out)
  before = (out / "metrics.jsonl").read_text()
  # A different student shape: one clear error, nothing written.
  rc = cli.main(["train", "--out", str(out), *ARGS, "--config.student.hidden_size=48"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "different student model" in err and "hidden_size: 32 in the checkpoint, 48 now" in err
  assert (out / "metrics.jsonl").read_text() == before
  # A save that never finished (what a crash mid-save leaves) is reported and never restored.
  shutil.copytree(out / "checkpoints" / "latest" / "8", out / "checkpoints" / "latest" / "10.orbax-checkpoint-tmp-1")
  assert cli.main(["train", "--out", str(out), *ARGS]) == 0
  assert "skipping incomplete checkpoint" in capsys.readouterr().err
  assert (out / "metrics.jsonl").read_text() == before
  # Truncate a file of the newest checkpoint's arrays (the OCDBT manifest: TensorStore's reads still in flight when
  # the restore fails call back into Orbax's closed event loop, which printed ~100-370 lines of tracebacks). The
  # command, run as a user runs it, prints one line: the step, where it moved, the command that resumes; the
  # detail (TensorStore's error and spec, the tracebacks) goes to checkpoints/restore_errors.log.
  latest = out / "checkpoints" / "latest"
  manifest = latest / "8" / "state" / "manifest.ocdbt"
  os.truncate(manifest, manifest.stat().st_size // 3)
  ten = [*ARGS[:2], "--config.train.steps=10", *ARGS[3:]]
  failed = _subprocess_train(out, args=ten)
  assert failed.returncode == 2, failed.stderr[-3000:]
  lines = failed.stderr.strip().splitlines()
  errors = [line for line in lines if line.startswith("opdjax: error: ")]
  # Only opdjax's own lines (the start-up phases, the schedule note, the one error): no traceback.
  assert all(line.startswith("opdjax: ") for line in lines) and len(lines) <= 8 and len(errors) == 1, \
      failed.stderr[-3000:]
  corrupt = out / "checkpoints" / "corrupt" / "8"
  log = out / "checkpoints" / "restore_errors.log"
  err = errors[0]
  assert "checkpoint step 8" in err and str(corrupt) in err and str(log) in err, err
  assert f"`opdjax train --out {out} --config configs/demo.py" in err and "now resumes from step 6" in err, err
  assert "--resume-fallback" in err and "tensorstore" not in err.lower() and len(err) < 1200, err
  detail = log.read_text()
  assert "Traceback" in detail and "manifest.ocdbt" in detail and "checkpoint step 8" in detail
  assert not (latest / "8").exists() and "cannot be restored" in (corrupt / "REASON").read_text()
  assert len((corrupt / "REASON").read_text().splitlines()) == 1
  # ... export no longer lists it, and the same command continues from step 6, re-running 7..10 once each.
  reader = RunCheckpointer(str(out / "checkpoints"))
  listed = reader.all_steps()
  reader.close()
  assert 8 not in listed and 6 in listed, listed
  rc = cli.main(["train", "--out", str(out), *ARGS[:2], "--config.train.steps=10", *ARGS[3:]])
  assert rc == 0
  assert [r["step"] for r in _records(out)] == list(range(11))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["halt", "skip"])
def test_nonfinite_loss(demo_cache, tmp_path, capsys, policy):
  out = tmp_path / policy
  rc = cli.main(["train", "--out", str(out), "--config", "configs/demo.py", *SMALL, "--config.train.steps=6",
                 "--config.train.checkpoint_every=1", "--config.optim.learning_rate=1e30",
                 "--config.optim.warmup_steps=1", f"--config.train.on_nonfinite={policy}"])
  recs = _records(out)
  if policy == "halt":
    assert rc == 2
    assert "non-finite loss" in capsys.readouterr().err
    bad = recs[-1]["step"]
    steps = sorted(int(s) for s in os.listdir(out / "checkpoints" / "latest") if s.isdigit())
    assert steps and max(steps) < bad  # the last checkpoint is from before the bad step
  else:
    assert rc == 0
    assert any(r.get("skipped") == 1.0 for r in recs[1:])


@pytest.mark.slow
def test_export_round_trips_through_transformers(reference, tmp_path, capsys):
  import numpy as np
  import torch
  import transformers

  from opdjax.models import load_hf_params
  from opdjax.pipeline.export import restore_student

  out = tmp_path / "hf"
  assert cli.main(["export", "--checkpoint", str(reference), "--out", str(out)]) == 0
  # The last checkpoint holds the run's final params: the same bytes the run wrote to student/.
  assert (out / "model.safetensors").read_bytes() == (reference / "student" / "model.safetensors").read_bytes()
  assert f"wrote the student of step 8 of {reference}" in capsys.readouterr().out  # which step it wrote
  assert cli.main(["export", "--checkpoint", str(reference), "--out", str(tmp_path / "hf4"), "--step", "4"]) == 0
  assert "wrote the student of step 4" in capsys.readouterr().out
  assert (tmp_path / "hf4" / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()
  model, params, meta = restore_student(str(reference), 4)
  assert meta["step"] == 4 and meta["engine"]["view"] == "lag=1" and meta["history_versions"] == [2, 3]
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf4").eval()
  tokens = np.array([[1, 5, 6, 13, 7, 8, 14]])
  with torch.no_grad():
    ref_logits = hf(torch.tensor(tokens)).logits.numpy()
  logits, _ = model.apply(load_hf_params(str(tmp_path / "hf4")), tokens, np.arange(7)[None], np.ones_like(tokens))
  assert np.abs(np.asarray(logits) - ref_logits).max() < 1e-4
  assert cli.main(["export", "--checkpoint", str(reference), "--out", str(out)]) == 2  # never overwrites


@pytest.mark.slow
def test_rescoring_a_rollout_after_resume_is_bit_exact(reference):
  """The checkpoint records params version, engine view and seeds: the rollout and its re-score come back."""
  import numpy as np

  from opdjax.models import load_hf_params
  from opdjax.pipeline.export import restore_student
  from opdjax.rollout import JaxEngine, SamplingParams
  from opdjax.scoring.rescore import batch_from_rollout, token_logprobs
  from opdjax.tasks.addition import AdditionTask
  from opdjax.views.view import EngineView

  model, params, meta = restore_student(str(reference))
  live = load_hf_params(str(reference / "student"))  # the params the finished run held in memory
  view = EngineView.parse(meta["engine"]["view"])
  sampling = SamplingParams(**meta["engine"]["sampling"])
  task = AdditionTask(meta["config"]["task"]["max_digits"])
  prompts, _ = task.train_batch(np.random.default_rng([meta["config"]["seed"], 3]), 16)

  def rescore(p):
    engine = JaxEngine(view.model(model), p, max_len=32, pad_id=0, eos_ids=(2,))
    batch = batch_from_rollout(engine.generate(prompts, sampling, seed=meta["config"]["seed"] * 1_000_003 + 3))
    return np.asarray(batch["tokens"]), np.asarray(token_logprobs(model, p, batch))

  (t1, lp1), (t2, lp2) = rescore(params), rescore(live)
  assert np.array_equal(t1, t2) and np.array_equal(lp1, lp2)


def test_a_run_state_comes_back_whole_from_its_checkpoint(tmp_path):
  """The checkpoint format in one place: what RunState saves (tree and metadata together) restores into a
  fresh state's shapes as the same RunState, including what the config cannot say: the view and depth the
  guard's backoffs left the sampler at, the guard's state, the params history. Another student is refused."""
  import jax.numpy as jnp

  from opdjax.errors import UserError
  from opdjax.pipeline.checkpoint import CheckpointOfAnotherModel, RunState
  from opdjax.pipeline.run_state import CheckpointOfAnotherLayout
  from opdjax.training.step import OptimConfig, TrainState, make_optimizer
  from opdjax.views.view import EngineView

  def state(seed):
    params = {"w": jax.random.normal(jax.random.key(seed), (4, 3)), "b": jnp.full((3,), float(seed))}
    return TrainState.create(params, make_optimizer(OptimConfig()))

  saved, older = state(1), state(2)
  run = RunState(step=6, train=saved, history_versions=[5, 6], history=[older.params, saved.params],
                 last_eval={"reverse_kl": 0.25, "eval_step": 6}, config={"seed": 3, "rollout": {"view": "lag=1"}},
                 student_config={"hidden_size": 32}, kind="jax", view=EngineView(weights="fp8"), depth=1,
                 async_mode="exact", sampling={"temperature": 1.0}, teacher_view="clean",
                 guard={"values": [0.5], "skip": 1, "events": 2}, versions={"opdjax": "x"})
  ckpt = RunCheckpointer(str(tmp_path / "ck"))
  ckpt.save_run(run)
  ckpt.wait()
  back = ckpt.restore_run(6, state(0), student_config={"hidden_size": 32})
  with pytest.raises(CheckpointOfAnotherModel, match="hidden_size: 32 in the checkpoint, 48 now"):
    ckpt.restore_run(6, state(0), student_config={"hidden_size": 48})
  # A checkpoint of an earlier train-state layout (its metadata has no state_layout): refused before any array is
  # read, with what to do, and left where it is.
  old_meta = {k: v for k, v in run.meta().items() if k != "state_layout"}
  ckpt.save(7, run.tree(), old_meta)
  ckpt.wait()
  with pytest.raises(CheckpointOfAnotherLayout, match="layout 1, written by another opdjax version.*opdjax export"):
    ckpt.restore_run(7, state(0), student_config={"hidden_size": 32})
  assert ckpt.all_steps() == [6, 7]
  ckpt.close()
  assert isinstance(CheckpointOfAnotherModel("x"), UserError)
  for a, b in zip(jax.tree.leaves((run.train, run.history)), jax.tree.leaves((back.train, back.history)), strict=True):
    assert np.array_equal(a, b)
  assert not np.array_equal(back.history[0]["w"], back.history[1]["w"])  # two versions, each its own
  assert back.view == EngineView(weights="fp8") and back.depth == 1 and back.guard == run.guard
  assert back.meta() == run.meta()  # every metadata field, the same JSON


SHARDED = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from opdjax.pipeline.checkpoint import RunCheckpointer

assert jax.device_count() == 4
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
x = jnp.arange(64.0).reshape(16, 4)
saved = {"w": jax.device_put(x, NamedSharding(mesh, P("fsdp", None))), "b": jnp.ones(3)}
ck = RunCheckpointer(sys.argv[1])
ck.save(1, saved, {"step": 1})
ck.wait()
target = {"w": jax.device_put(jnp.zeros((16, 4)), NamedSharding(mesh, P(None, "fsdp"))),
          "b": jax.device_put(jnp.zeros(3), NamedSharding(mesh, P()))}
out, meta = ck.restore(1, target)
assert np.array_equal(out["w"], x) and meta == {"step": 1}
assert out["w"].sharding == target["w"].sharding, out["w"].sharding
assert len(out["w"].addressable_shards) == 4 and out["w"].addressable_shards[0].data.shape == (16, 1)
print("ok")
"""


def test_restore_into_other_shardings_on_four_host_devices(tmp_path):
  res = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "ck")], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "4"}, timeout=300)
  assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.slow
def test_full_disk_fails_loudly_and_keeps_earlier_checkpoints(demo_cache, tmp_path, capsys):
  """A real 1.5 MiB tmpfs: the run stops with an error, and the newest complete checkpoint restores."""
  from opdjax.pipeline.export import restore_student

  disk = tmp_path / "disk"
  disk.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(disk)], capture_output=True)
  if mounted.returncode:
    pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
  try:
    out = disk / "run"
    rc = cli.main(["train", "--out", str(out), "--config", "configs/demo.py", *SMALL, "--config.train.steps=200",
                   "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=50",
                   "--config.train.best_metric="])
    assert rc != 0
    assert "No space left" in capsys.readouterr().err
    model, params, meta = restore_student(str(out))
    assert meta["step"] >= 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
  finally:
    if subprocess.run(["umount", str(disk)]).returncode:
      subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_best_is_its_own_copy_of_a_step_latest_also_holds(demo_cache, tmp_path):
  import orbax.checkpoint as ocp

  out = tmp_path / "run"  # latest keeps every step, so it holds best's
  assert cli.main(["train", "--out", str(out), "--config", "configs/demo.py", *SMALL, "--config.train.steps=2",
                   "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=3"]) == 0
  root = out / "checkpoints"
  best = sorted(int(d) for d in os.listdir(root / "best") if d.isdigit())
  latest = sorted(int(d) for d in os.listdir(root / "latest") if d.isdigit())
  both = set(best) & set(latest)
  assert len(best) == 1 and both, (best, latest)
  assert json.loads((root / "best" / "BEST.json").read_text())["step"] == best[0]
  step = max(both)

  def inodes(d):
    return {os.stat(os.path.join(r, f)).st_ino for r, _, fs in os.walk(d) for f in fs}

  # Its own files (a flipped bit in one is not in the other: tests/test_checkpoint_integrity.py) ...
  ours = inodes(root / "best" / str(step))
  assert ours and not ours & inodes(root / "latest" / str(step))
  # ... restoring to the same arrays as latest's copy.
  with ocp.StandardCheckpointer() as ck:
    a = ck.restore(root / "best" / str(step) / "state")
    b = ck.restore(root / "latest" / str(step) / "state")
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 0
  assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))
