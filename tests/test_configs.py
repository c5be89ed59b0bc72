"""Every configs/*.py loads, converts to the typed configs, and overrides are checked."""

import glob
import os

import pytest

from opdjax.config.loader import ConfigError, apply_overrides, load_config_file
from opdjax.training.loss import LossConfig
from opdjax.training.step import OptimConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def test_there_are_configs():
  assert len(CONFIGS) >= 2


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_and_types(path):
  cfg = load_config_file(path)
  LossConfig(**cfg.loss)
  OptimConfig(**cfg.optim)
  assert cfg.train.steps > 0
  assert cfg.rollout.max_len >= cfg.rollout.max_new_tokens


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


def test_bad_loss_value_is_rejected():
  cfg = apply_overrides(load_config_file(CONFIGS[0]), {"loss.kind": "kl_typo"})
  with pytest.raises(ValueError, match="choose one of"):
    LossConfig(**cfg.loss)


def test_missing_config_file():
  with pytest.raises(ConfigError, match="not found"):
    load_config_file("configs/does_not_exist.py")


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_configs_are_locked(path):
  cfg = load_config_file(path)
  with pytest.raises(AttributeError):
    cfg.train.stepz = 3  # a typo in a config file is an error, not a new key
