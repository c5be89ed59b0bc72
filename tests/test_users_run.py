"""End to end (issue 45): a student and teacher by Hub id from a local HF cache (offline), chat prompts from a
local parquet, W&B offline (and trackio where installed) whose stores hold the logged steps, samples.jsonl and
the length fields, the length guard halting a run made to truncate, and `opdjax.train` from Python."""

import glob
import json
import os
import sqlite3
import struct

import numpy as np
import pytest
import tiny_hub

from opdjax import cli

pytestmark = pytest.mark.slow  # OPD runs of a few steps on tiny HF models

TEACHER, STUDENT = "tiny-org/teacher", "tiny-org/student"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """An HF cache holding the two models, and a parquet of chat prompts."""
  datasets = pytest.importorskip("datasets")
  root = tmp_path_factory.mktemp("users")
  tiny_hub.cache_entry(root / "hf", TEACHER, tiny_hub.model_folder(root / "teacher", hidden=32, layers=2, seed=0))
  tiny_hub.cache_entry(root / "hf", STUDENT, tiny_hub.model_folder(root / "student", hidden=16, layers=1, seed=1))
  msgs = [[{"role": "user", "content": p}] for p in tiny_hub.prompts(40)]
  datasets.Dataset.from_dict({"messages": msgs}).to_parquet(str(root / "prompts.parquet"))
  return root


@pytest.fixture
def env(world, tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", str(world / "hf"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
  return world


def _args(world, out, *extra):
  return ["train", "--config", "configs/demo.py", "--out", str(out), "--config.task.name=prompts",
          f"--config.task.dataset={world / 'prompts.parquet'}", "--config.task.messages_field=messages",
          "--config.task.num_eval=8", f"--config.teacher.path={TEACHER}", f"--config.student.path={STUDENT}",
          "--config.rollout.batch_size=8", "--config.rollout.max_new_tokens=8", "--config.loss.kind=sampled_rkl",
          *extra]


def _records(out):
  return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def wandb_store(out) -> tuple[list[dict], dict]:
  """(history rows, config) of the offline W&B run under OUT/wandb, read from its run-*.wandb file (a
  LevelDB-style log of protobuf records: 7-byte header, 32 KiB blocks, records split across blocks)."""
  from wandb.proto import wandb_internal_pb2 as pb

  (path,) = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, block, chunks, buf = 7, 32768, [], b""
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    pos += 7
    if kind == 0:  # block padding
      pos += left - 7
      continue
    piece, pos = data[pos:pos + length], pos + length
    if kind == 1:
      chunks.append(piece)
    elif kind == 2:
      buf = piece
    elif kind == 3:
      buf += piece
    elif kind == 4:
      chunks.append(buf + piece)
  history, config = [], {}
  for chunk in chunks:
    rec = pb.Record()
    rec.ParseFromString(chunk)
    what = rec.WhichOneof("record_type")
    if what == "history":
      history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    elif what == "run":
      config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    elif what == "config":
      config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
  return history, config


def test_hub_ids_a_dataset_wandb_offline_samples_and_length_fields(env, tmp_path):
  pytest.importorskip("wandb")
  from opdjax.pipeline.writers.trackers import source_commit

  out = tmp_path / "run"
  assert cli.main(_args(env, out, "--config.train.steps=4", "--config.train.log_samples_every=2",
                        "--config.train.loggers=jsonl,wandb")) == 0
  recs = _records(out)
  assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
  for r in recs[1:]:  # every step's length fields, consistent with each other
    assert 1 <= r["completion_len_mean"] <= r["completion_len_max"] <= 8
    assert 0 <= r["truncated_frac"] <= 1 and 0 <= r["eos_frac"] <= 1 and r["truncated_frac"] + r["eos_frac"] <= 1
  # W&B's offline store holds every step's numbers as metrics.jsonl has them, the config once and the commit
  history, config = wandb_store(out)
  by_step = {h["_step"]: h for h in history if "loss" in h or "reverse_kl" in h}
  assert sorted(by_step) == [0, 1, 2, 3, 4]
  for r in recs[1:]:
    for k in ("loss", "train_reverse_kl", "truncated_frac", "completion_len_mean"):
      assert by_step[r["step"]][k] == pytest.approx(r[k]), k
  assert config["train"]["steps"] == 4 and config["student"]["path"] == STUDENT
  assert config["opdjax_commit"] == source_commit() != ""
  # samples.jsonl: a few rows every 2 steps, the prompt through the student's chat template
  samples = [json.loads(line) for line in open(out / "samples.jsonl")]
  assert [s["step"] for s in samples] == [2] * 4 + [4] * 4
  for s in samples:
    assert s["prompt"].startswith("user: ") and s["prompt"].endswith("assistant:")
    assert s["ended"] in ("eos", "truncated", "stopped") and 1 <= s["completion_tokens"] <= 8
    assert 1 <= len(s["highlights"]) <= 5 and all(np.isfinite(kl) for _, kl in s["highlights"])
    assert np.isfinite(s["reverse_kl_mean"])
  # ... and the same rows as W&B tables at those steps
  tables = {h["_step"]: h for h in history if h.get("samples/_type") == "table-file"}
  assert sorted(tables) == [2, 4] and all(t["samples/nrows"] == 4 for t in tables.values())
  (files,) = glob.glob(os.path.join(out, "wandb", "offline-run-*", "files"))
  table = json.load(open(os.path.join(files, tables[2]["samples/path"])))
  col = table["columns"].index("completion")
  assert [row[col] for row in table["data"]] == [s["completion"] for s in samples if s["step"] == 2]
  truncated = [s["ended"] == "truncated" for s in samples if s["step"] == 4]
  assert recs[4]["truncated_frac"] == 1.0 or not all(truncated)  # rows of the step agree with its share


def test_trackio_store_holds_the_steps(env, tmp_path):
  pytest.importorskip("trackio", reason="trackio is not installed (pip install 'opdjax[trackers]')")
  out = tmp_path / "run"
  assert cli.main(_args(env, out, "--config.train.steps=3", "--config.train.loggers=jsonl,trackio",
                        "--config.train.tracker_project=opdjax-test")) == 0
  recs = _records(out)
  (db,) = glob.glob(str(tmp_path / "trackio" / "*.db"))
  with sqlite3.connect(db) as conn:
    rows = conn.execute("SELECT step, metrics FROM metrics").fetchall()
  logged = {int(step): json.loads(m) for step, m in rows}
  for r in recs[1:]:
    assert logged[r["step"]]["loss"] == pytest.approx(r["loss"])


def test_the_length_guard_halts_a_run_made_to_truncate(env, tmp_path, capsys):
  """A random student never samples EOS in 4 tokens: every row truncates, and the guard stops the run after its
  first full window, checkpointed; with the guard off the same run goes on."""
  out = tmp_path / "run"
  extra = ("--config.rollout.max_new_tokens=4", "--config.train.steps=6", "--config.train.length_guard_window=2")
  rc = cli.main(_args(env, out, *extra, "--config.train.length_guard=halt"))
  err = capsys.readouterr().err
  assert rc == 2, err
  assert "length guard: at step 2, 100% of the last 2 steps' completions hit rollout.max_new_tokens" in err
  recs = _records(out)
  # step 2's record acts; step 3 was dispatched before it was read (as the mismatch guard), and the run
  # stops after it, checkpointed
  assert "halt" in recs[2]["length_guard_event"] and recs[-1]["step"] == 3
  assert all(r["truncated_frac"] == 1.0 for r in recs[1:])
  assert os.path.isdir(out / "checkpoints" / "latest" / "3")
  free = tmp_path / "free"
  assert cli.main(_args(env, free, *extra, "--config.train.length_guard=off")) == 0
  assert _records(free)[-1]["step"] == 6


def test_opdjax_train_from_python_returns_the_records(env, tmp_path):
  import jax

  import opdjax
  from opdjax.models import load_hf_params
  from opdjax.models.hub import snapshot

  run = opdjax.train("configs/demo.py", out=tmp_path / "run", progress=False, overrides={
      "task.name": "prompts", "task.dataset": str(env / "prompts.parquet"), "task.messages_field": "messages",
      "task.num_eval": 8, "teacher.path": TEACHER, "student.path": STUDENT, "rollout.batch_size": 8,
      "rollout.max_new_tokens": 8, "loss.kind": "sampled_rkl", "train.steps": 3, "optim.learning_rate": 0.01,
      "optim.warmup_steps": 1})
  assert [r["step"] for r in run.records] == [0, 1, 2, 3]
  assert run.records == _records(run.out)
  assert run.config.train.steps == 3 and isinstance(run.config.optim.learning_rate, float)
  start = load_hf_params(snapshot(STUDENT))
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(start), strict=True))
  assert moved > 1e-4  # the trained student, not the one it started from
  assert run.evaluate()["reverse_kl"] == pytest.approx(run.records[-1]["reverse_kl"], rel=1e-4)
  assert run.evaluate(start)["reverse_kl"] == pytest.approx(run.records[0]["reverse_kl"], rel=1e-4)
