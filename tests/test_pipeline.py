"""The one OPD pipeline: typed config (every configs/*.py built, overrides checked), --out safety,
config changes on resume, TensorBoard events, the seed rule, and the sweeps running the loop
`opdjax train` runs."""

import glob
import json
import os

import pytest

from opdjax import cli, seeds
from opdjax.analyses.sweep import sweep_config, train_run
from opdjax.config.defaults import default_config
from opdjax.config.loader import ConfigError, apply_overrides, load_config_file
from opdjax.config.schema import Config, build, flat
from opdjax.pipeline.session import Session
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig
from opdjax.views.view import EngineView

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
SMALL = ["--config.task.num_eval=16", "--config.rollout.batch_size=16"]


def _train(out, *extra):
  return cli.main(["train", "--config", "configs/demo.py", "--out", str(out), *SMALL, *extra])


def _records(out):
  return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


# --- typed config ------------------------------------------------------------------------------

def test_the_shipped_configs_are_found():
  assert len(CONFIGS) >= 2 and os.path.join(ROOT, "configs", "demo.py") in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_builds_completely(path, tmp_path):
  loaded = load_config_file(path)
  with pytest.raises(AttributeError):
    loaded.train.stepz = 3  # locked: a typo in a config file is an error, not a new key
  overrides = {}
  if "qwen3" in path:  # paths come from the command line; give real folders and files
    for role in ("teacher", "student"):
      (tmp_path / role).mkdir()
      overrides[f"{role}.path"] = str(tmp_path / role)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    overrides["task.path"] = str(tmp_path / "p.jsonl")
  cfg = build(apply_overrides(loaded, overrides))
  assert isinstance(cfg, Config)
  assert set(flat(cfg.to_dict())) == set(flat(Config().to_dict()))  # every key, typed
  assert build(cfg.to_dict()) == cfg  # what config.json records rebuilds the same config
  assert isinstance(cfg.loss, LossConfig) and isinstance(cfg.optim, OptimConfig)
  assert cfg.train.steps > 0 and cfg.rollout.max_len >= cfg.rollout.max_new_tokens


def test_override_sets_typed_values():
  cfg = load_config_file(CONFIGS[0])
  out = apply_overrides(cfg, {"train.steps": "7", "optim.learning_rate": "1", "loss.kind": "jsd"})
  assert out.train.steps == 7
  assert isinstance(out.optim.learning_rate, float) and out.optim.learning_rate == 1.0
  assert out.loss.kind == "jsd"
  assert cfg.train.steps != 7  # the original is untouched


@pytest.mark.parametrize("key,value,match", [
    ("train.stepz", "3", "train has no 'stepz'"),
    ("nope.x", "3", "<root> has no 'nope'"),
    ("train.steps", "abc", "cannot parse"),
    ("train.steps", "1.5", "expected int"),
])
def test_bad_override_is_one_clear_error(key, value, match):
  with pytest.raises(ConfigError, match=match):
    apply_overrides(load_config_file(CONFIGS[0]), {key: value})


def test_bad_loss_value_is_rejected_by_the_section_itself():
  cfg = apply_overrides(load_config_file(CONFIGS[0]), {"loss.kind": "kl_typo"})
  with pytest.raises(ValueError, match="choose one of"):
    LossConfig(**cfg.loss)


def test_missing_config_file():
  with pytest.raises(ConfigError, match="not found"):
    load_config_file("configs/does_not_exist.py")


@pytest.mark.parametrize("key,value,match", [
    ("rollout.view", "weights=fp9", "rollout.view: unknown recipe preset 'fp9'"),
    ("rollout.engine", "sglang", "rollout.engine='sglang'; choose one of 'jax', 'vllm'"),
    ("teacher.view", "lag=2", "teacher.view cannot have a lag"),
    ("train.on_nonfinite", "ignore", "train.on_nonfinite='ignore'; choose one of 'halt', 'skip'"),
    ("mismatch.sources", "clean;kv_quant=int4", "mismatch.sources: kv_quant='int4'"),
    ("model.remat_policy", "some", "model.remat_policy='some'; choose one of 'nothing', 'dots', 'full'"),
    ("loss.kind", "kl_typo", "loss.kind='kl_typo'; choose one of"),
    ("rollout.max_new_tokens", "40", "rollout.max_len=32 must exceed rollout.max_new_tokens=40"),
    ("teacher.path", "/nonexistent/folder", "teacher.path='/nonexistent/folder' is not a folder"),
])
def test_bad_values_are_one_error_naming_the_key(key, value, match):
  with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
    build(apply_overrides(default_config(), {key: value}))


def test_bad_override_type_names_the_expected_type(tmp_path, capsys):
  assert _train(tmp_path / "x", "--config.train.steps=ten") == 2
  assert "--config.train.steps: cannot parse 'ten' as int" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "x")


def test_print_config_lists_every_key(tmp_path, capsys):
  assert cli.main(["calibrate", "--out", str(tmp_path / "c"), "--print-config", "--config.calibrate.seeds=4"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == len(flat(Config().to_dict()))
  values = dict(line.split("  #")[0].rstrip().split(" = ", 1) for line in lines)  # each key's description after it
  assert values["calibrate.seeds"] == "4" and values["rollout.vllm.extra_args"] == "''"
  assert not os.path.exists(tmp_path / "c")


def test_seed_rule_separates_purposes_steps_and_seeds():
  a = seeds.derive(0, 3, "prompts")
  assert a == seeds.derive(0, 3, "prompts")
  assert len({a, seeds.derive(0, 3, "sample"), seeds.derive(0, 4, "prompts"), seeds.derive(1, 3, "prompts")}) == 4
  assert 0 <= a < 2**31


# --- --out safety --------------------------------------------------------------------------------

@pytest.mark.slow
def test_refused_train_leaves_nothing_and_a_retry_is_refused_too(demo_cache, tmp_path, capsys):
  out = tmp_path / "theirs"
  out.mkdir()
  (out / "metrics.jsonl").write_text("not ours\n")
  for _ in range(2):  # the identical retry must be refused the same way
    assert _train(out, "--config.train.steps=1") == 2
    assert "holds no opdjax train run" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["metrics.jsonl"] and (out / "metrics.jsonl").read_text() == "not ours\n"
  # --out naming a file: one message about the folder, not about free space.
  (tmp_path / "file").write_text("x")
  assert _train(tmp_path / "file", "--config.train.steps=1") == 2
  assert "is a file; give a folder" in capsys.readouterr().err
  # Every analysis command has the same policy, and --overwrite writes into the folder.
  assert cli.main(["mismatch", "--out", str(out), *SMALL, "--config.mismatch.sources=clean",
                   "--config.mismatch.warmup_steps=1", "--config.mismatch.num_prompts=4"]) == 2
  assert "`opdjax mismatch` does not resume into a used folder" in capsys.readouterr().err
  assert cli.main(["mismatch", "--out", str(out), "--overwrite", *SMALL, "--config.mismatch.sources=clean",
                   "--config.mismatch.warmup_steps=1", "--config.mismatch.num_prompts=4"]) == 0
  assert (out / "mismatch.json").exists() and (out / "metrics.jsonl").read_text() == "not ours\n"


@pytest.mark.slow
def test_resume_refuses_meaning_changes_and_records_extensions(demo_cache, tmp_path, capsys, monkeypatch):
  from opdjax.pipeline import run

  out = tmp_path / "run"
  assert _train(out, "--config.train.steps=2") == 0
  config_before = (out / "config.json").read_text()
  metrics_before = (out / "metrics.jsonl").read_text()
  capsys.readouterr()
  session = run.Session
  monkeypatch.setattr(run, "Session", None)  # refused from OUT/config.json: no model loads, no server starts
  for change, key in (("--config.loss.kind=jsd", "loss.kind"), ("--config.optim.learning_rate=0.05",
                                                                 "optim.learning_rate"),
                      ("--config.rollout.view=lag=1", "rollout.view"), ("--config.seed=3", "seed")):
    assert _train(out, "--config.train.steps=2", change) == 2
    err = capsys.readouterr().err
    assert key in err and "change what the run means" in err, err
    assert (out / "metrics.jsonl").read_text() == metrics_before
  os.rename(out / "config.json", out / "config.json.away")
  monkeypatch.setattr(run, "Session", session)
  # Without it, the checkpoint's config says so (a key the demo's models do not depend on: a new seed would build
  # the seed's demo teacher and student, 1300 supervised steps, before the checkpoint is read).
  assert _train(out, "--config.train.steps=2", "--config.optim.learning_rate=0.05") == 2
  assert "optim.learning_rate" in capsys.readouterr().err
  os.rename(out / "config.json.away", out / "config.json")
  assert _train(out, "--config.train.steps=3", "--config.train.eval_every=2") == 0
  captured = capsys.readouterr()
  assert "resuming with train.steps changed: 2 -> 3" in captured.err
  assert "resumed at step 2, ran to step 3" in captured.out  # the summary is of this invocation
  assert (out / "config.json").read_text() == config_before
  history = [json.loads(line) for line in open(out / "config_history.jsonl")]
  assert [h["resumed"] for h in history] == [False, True]
  assert history[1]["changes"]["train.steps"] == [2, 3]
  # The resumed update follows the 3-step schedule (halfway down its cosine: 0.55 x the peak), not the saved
  # state's 2-step one (ended: 0.1 x); the first two updates ran the 2-step one (a warmup from 0, then the peak).
  peak = json.loads(config_before)["optim"]["learning_rate"]
  lrs = [r["learning_rate"] for r in _records(out) if "learning_rate" in r]
  assert lrs == [0.0, pytest.approx(peak), pytest.approx(0.55 * peak, rel=1e-6)], lrs
  assert [r["step"] for r in _records(out)] == [0, 1, 2, 3]


@pytest.mark.slow
def test_tensorboard_events_have_reverse_kl_only_where_measured(demo_cache, tmp_path, capsys):
  """eval_every=2: held-out values at steps 0, 2, 4 only (no stairs); training metrics at every step."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  out = tmp_path / "tb"
  assert _train(out, "--config.train.steps=4", "--config.train.eval_every=2",
                "--config.train.loggers=jsonl,tensorboard") == 0
  err = capsys.readouterr().err
  assert "\r" not in err and "\x1b[" not in err  # not a terminal: plain progress lines, no bar frames
  assert "OPD: step 4/4 rev=" in err
  acc = EventAccumulator(str(out / "tensorboard"))
  acc.Reload()
  assert [e.step for e in acc.Scalars("reverse_kl")] == [0, 2, 4]
  assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
  recs = _records(out)
  assert recs[3]["eval_step"] == 2 and recs[3]["reverse_kl"] == recs[2]["reverse_kl"]  # metrics.jsonl carries it
  want = [r["reverse_kl"] for r in recs if r.get("eval_step", 0) == r["step"]]
  assert [e.value for e in acc.Scalars("reverse_kl")] == pytest.approx(want, rel=1e-6)


# --- one loop ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_calibration_runs_the_loop_train_runs(demo_cache, tmp_path):
  view = "noise_sigma=0.2,lag=1"
  # The config's seed (0): the demo's models are cached per seed, and another would build its own pair.
  args = ["--config.train.steps=2", "--config.optim.total_steps=2", f"--config.rollout.view={view}"]
  assert _train(tmp_path / "t", *args) == 0
  trained = _records(tmp_path / "t")
  cfg = default_config()
  cfg.task.num_eval, cfg.rollout.batch_size = 16, 16
  session = Session(sweep_config(build(cfg), steps=2, eval_every=1), progress=False)
  swept = train_run(session, EngineView.parse(view), seed=cfg.seed)
  assert [r["step"] for r in swept] == [0, 1, 2]
  keys = [k for k in trained[2] if k != "elapsed_s"]
  assert "loss" in keys and "mismatch_kl_k3_tok" in keys and "reverse_kl" in keys
  for t, s in zip(trained[1:], swept[1:]):
    assert {k: t[k] for k in keys} == {k: s[k] for k in keys}
  assert swept[2]["mismatch_kl_k3_tok"] > 0  # the view really perturbed the engine
  other = train_run(session, EngineView.parse(view), seed=6)
  assert other[1]["loss"] != swept[1]["loss"]  # and the seed really picks the run


def test_teacher_folder_without_tokenizer_is_one_clear_error(tmp_path):
  from opdjax.errors import UserError
  from opdjax.tasks.prompts import PromptsTask

  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "config.json").write_text("{}")
  (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n' * 3)
  with pytest.raises(UserError, match="has no tokenizer files"):
    PromptsTask(str(tmp_path / "p.jsonl"), str(tmp_path / "model"), 1, False, 10)


def test_progress_in_a_log_is_plain_lines():
  import io

  from opdjax.progress import bar

  out = io.StringIO()  # not a terminal
  assert list(bar(range(3), desc="views", stream=out)) == [0, 1, 2]
  b = bar(desc="sweep", total=2, stream=out)
  b.update()
  b.update()
  text = out.getvalue()
  assert text.splitlines() == ["views: 3/3", "sweep: 2/2"] and "\r" not in text and "\x1b[" not in text
