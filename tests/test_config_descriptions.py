"""Every config key has a one-line description, which `--print-config` prints beside its value, with or
without --out and before a pair's paths are chosen (issue 51, item 6)."""

import pytest

from opdjax import cli
from opdjax.config.descriptions import DESCRIPTIONS
from opdjax.config.schema import Config, flat


def test_every_config_key_has_a_description():
  keys = set(flat(Config().to_dict()))
  missing = sorted(keys - set(DESCRIPTIONS))
  assert not missing, f"give these keys a line in opdjax/config/descriptions.py: {missing}"
  assert not sorted(set(DESCRIPTIONS) - keys), "descriptions of keys that no longer exist"
  assert all(d and "\n" not in d for d in DESCRIPTIONS.values())


def test_print_config_without_out_and_with_empty_paths(capsys):
  assert cli.main(["train", "--config", "configs/demo.py", "--print-config", "--config.train.steps=7"]) == 0
  out = capsys.readouterr().out.splitlines()
  line = next(s for s in out if s.startswith("train.steps = 7"))
  assert line.endswith("# " + DESCRIPTIONS["train.steps"])
  # A prompts config before a pair is chosen: listed all the same, what is missing on the last line.
  assert cli.main(["train", "--config", "configs/demo.py", "--print-config", "--config.task.name=prompts"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert any(s.startswith("teacher.path = ''") for s in out)
  assert out[-1].startswith("# not runnable as it is:") and "task.path is empty" in out[-1], out[-1]


def test_train_still_needs_out(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "--config", "configs/demo.py"])
  assert e.value.code == 2 and "required: --out" in capsys.readouterr().err
