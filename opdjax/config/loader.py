"""Config files (`configs/*.py` exporting `get_config()`) and `--config.a.b=v` overrides.

ConfigDicts stay at the boundary: `typed()` turns one into frozen dataclasses
before anything is jitted.
"""

from __future__ import annotations

import ast
import importlib.util
import os

import ml_collections

from opdjax.config.train_section import gone
from opdjax.errors import UserError


class ConfigError(UserError):
  pass


def load_config_file(path: str) -> ml_collections.ConfigDict:
  if not os.path.exists(path):
    raise ConfigError(f"config file {path} not found; pass a configs/*.py file exporting get_config().")
  spec = importlib.util.spec_from_file_location(f"_opdjax_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path} has no get_config(); a config file must define one.")
  cfg = module.get_config()
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise ConfigError(f"{path}: get_config() must return an ml_collections.ConfigDict.")
  return cfg


def _parse_value(text: str, like):
  if isinstance(like, bool) or like is None:  # None: a switch chosen at start-up unless set (auto)
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    if like is None and text.lower() in ("auto", "none"):
      return None
    raise ConfigError(f"expected true/false{'/auto' if like is None else ''}, got {text!r}")
  if isinstance(like, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    raise ConfigError(f"cannot parse {text!r} as {type(like).__name__}") from None
  if isinstance(like, float) and isinstance(value, int):
    value = float(value)
  if like is not None and not isinstance(value, type(like)):
    raise ConfigError(f"expected {type(like).__name__}, got {text!r}")
  return value


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, str]) -> ml_collections.ConfigDict:
  """Sets dotted keys; a key that does not exist is an error naming the valid ones."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  for dotted, text in overrides.items():
    node = cfg
    parts = dotted.split(".")
    for i, key in enumerate(parts):
      if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        if gone(dotted):
          raise ConfigError(f"--config.{gone(dotted)}")
        where = ".".join(parts[:i]) or "<root>"
        valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        raise ConfigError(f"unknown config key --config.{dotted}: {where} has no {key!r}; valid keys: {valid}")
      if i < len(parts) - 1:
        node = node[key]
    try:
      node[parts[-1]] = _parse_value(text, node[parts[-1]])
    except ConfigError as e:
      raise ConfigError(f"--config.{dotted}: {e}") from None
  cfg.lock()
  return cfg
