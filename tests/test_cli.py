"""The command registry: every command's --help, what the help says about --config against what the
command does, the one override syntax, and `opdjax launch sidecar`."""

import shlex

import pytest

from opdjax import cli
from opdjax.config.loader import ConfigError
from opdjax.config.resolve import resolve_config, split_overrides


def _help(capsys, *words) -> str:
  with pytest.raises(SystemExit) as e:
    cli.main([*words, "--help"])
  assert e.value.code == 0
  return capsys.readouterr().out


def _usage(text: str) -> str:
  return " ".join(text.split("\n\n")[0].split())


@pytest.mark.parametrize("cmd", cli.COMMANDS, ids=lambda c: c.name)
def test_every_commands_help_says_how_it_takes_its_config(cmd, capsys):
  text = _help(capsys, *cmd.name.split())
  usage = _usage(text)
  assert f"opdjax {cmd.name} [-h]" in usage
  if cmd.config is None:
    assert "--config" not in text and "--print-config" not in text
    return
  assert f"Config: {cli.CONFIG_MODES[cmd.config]}." in text
  assert ("[--print-config]" in usage) == (cmd.config != "budget")
  if cmd.config == "required":
    assert "--config FILE" in usage and "[--config FILE]" not in usage
  elif cmd.config == "default":
    assert "[--config FILE]" in usage and "configs/demo.py" in text
  elif cmd.config == "budget":  # admit: the budget's config; --teacher admits the served teacher of a run's config
    assert "[--config FILE]" in usage and "[--teacher]" in usage
  else:
    assert "--config FILE" not in usage  # the demo takes no config file


def test_top_level_help_names_each_commands_config_and_print_config(capsys):
  text = _help(capsys)
  assert "train, launch sidecar: --config FILE is required" in text
  assert "demo: always the demo's config" in text and "--print-config prints every key" in text
  assert "kv-capacity, plan, export, models fetch: no config" in text
  assert "(the demo's when absent)" not in text  # what it said of every command, train included


def test_the_default_config_is_the_demos_as_the_help_says(capsys):
  assert cli.main(["mismatch", "--print-config", "--config.train.steps=7"]) == 0
  default = capsys.readouterr().out
  assert cli.main(["mismatch", "--print-config", "--config", "configs/demo.py", "--config.train.steps=7"]) == 0
  assert capsys.readouterr().out == default and any(s.startswith("train.steps = 7 ") for s in default.splitlines())
  assert cli.main(["demo", "--out", "x", "--print-config", "--config.train.steps=7"]) == 0
  assert capsys.readouterr().out == default


def test_required_config_and_strange_flags_exit_2(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "--out", "x", "--config.train.steps=3"])
  assert e.value.code == 2 and "required: --config" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:  # a command without a config takes no --config.* flags
    cli.main(["export", "--checkpoint", "a", "--out", "b", "--config.train.steps=3"])
  assert e.value.code == 2 and "unrecognized arguments: --config.train.steps=3" in capsys.readouterr().err
  assert cli.main(["calibrate", "--out", "x", "--steps=3"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("opdjax: error: unrecognised argument '--steps=3'") and len(err.splitlines()) == 1


def test_override_flags_forms_and_errors():
  assert split_overrides(["--config.train.steps=3", "--config.rollout.view", "lag=1,weights=fp8"]) == {
      "train.steps": "3", "rollout.view": "lag=1,weights=fp8"}
  with pytest.raises(ConfigError, match="needs a value: --config.seed=VALUE"):
    split_overrides(["--config.seed"])
  with pytest.raises(ConfigError, match="overrides look like --config.train.steps=10"):
    split_overrides(["train.steps=3"])
  cfg = resolve_config("configs/demo.py", split_overrides(["--config.train.steps=3", "--config.loss.kind=jsd"]))
  assert (cfg.train.steps, cfg.loss.kind) == (3, "jsd") and resolve_config(None, {}).train.steps != 3


def test_launch_sidecar_prints_one_servers_command(capsys, monkeypatch):
  monkeypatch.setenv("OPDJAX_SIDECAR_TOKEN", "t" * 32)  # a sidecar beyond loopback needs one
  assert cli.main(["launch", "sidecar", "--config", "configs/demo.py", "--model", "/models/m", "--port", "8123",
                   "--tp", "2", "--out", "runs/x", "--config.rollout.max_len=48"]) == 0
  cmd = shlex.split(capsys.readouterr().out.strip())
  opt = lambda flag: cmd[cmd.index(flag) + 1]
  assert cmd[0] == "env" and "VLLM_SERVER_DEV_MODE=1" in cmd and "t" * 32 not in " ".join(cmd)
  assert (opt("--model"), opt("--port"), opt("--tensor-parallel-size"), opt("--max-model-len")) == (
      "/models/m", "8123", "2", "48")
  assert opt("--host") == "0.0.0.0"


def test_train_on_cpu_jax_with_gpus_visible_is_refused_with_the_install_line(capsys, monkeypatch, tmp_path):
  """A GPU config (bf16 compute) where GPUs are visible (faked) but JAX has only its CPU backend: one
  line naming `pip install -e '.[gpu]'`, exit 2, and nothing written."""
  from opdjax.parallel import gpu

  monkeypatch.setattr(gpu, "visible_gpus", lambda: 8)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  out = tmp_path / "run"
  assert cli.main(["train", "--config", "configs/demo.py", "--out", str(out), "--config.model.dtype=bfloat16"]) == 2
  err = capsys.readouterr().err
  assert "8 GPU(s) visible" in err and "pip install -e '.[gpu]'" in err and "model.dtype=bfloat16" in err, err
  assert not out.exists() or not any(out.iterdir())


def test_a_bf16_config_on_cpu_is_refused_before_any_work_naming_float32(capsys, monkeypatch, tmp_path):
  """bf16 compute on XLA:CPU dies in the first train step (no BF16 x BF16 = F32 dot): refused at the start with
  one line naming --config.model.dtype=float32, nothing written (docs/guide.md, README's CPU recipe)."""
  import time

  from opdjax.parallel import gpu

  monkeypatch.setattr(gpu, "visible_gpus", lambda: 0)
  out = tmp_path / "run"
  t = time.perf_counter()
  assert cli.main(["train", "--config", "configs/demo.py", "--out", str(out), "--config.model.dtype=bfloat16"]) == 2
  err = capsys.readouterr().err
  assert "model.dtype=bfloat16 cannot train on JAX's CPU backend" in err and "--config.model.dtype=float32" in err
  assert len(err.strip().splitlines()) == 1 and time.perf_counter() - t < 5, err
  assert not out.exists() or not any(out.iterdir())
