"""A config file plus `--config.SECTION.KEY=VALUE` flags -> the typed `Config`.

The one path from a command line to a config: `opdjax` and every script under scripts/ resolve
theirs here, so an override means the same thing wherever it is given.
"""

from __future__ import annotations

import contextlib

from opdjax.config.defaults import default_config
from opdjax.config.loader import ConfigError, apply_overrides, load_config_file
from opdjax.config.schema import Config, build
from opdjax.config.sections import CHECK_PATHS


def split_overrides(extra: list[str]) -> dict[str, str]:
  """`--config.a.b=v` and `--config.a.b v` flags -> {"a.b": "v"}; anything else is an error naming the form."""
  out = {}
  it = iter(extra)
  for arg in it:
    if not arg.startswith("--config."):
      raise ConfigError(f"unrecognised argument {arg!r}; overrides look like --config.train.steps=10")
    key, eq, value = arg[len("--config."):].partition("=")
    if not eq:
      value = next(it, None)
      if value is None:
        raise ConfigError(f"{arg} needs a value: --config.{key}=VALUE")
    out[key] = value
  return out


def resolve_config(path: str | None, overrides: dict[str, str]) -> Config:
  """`path`'s get_config() with `overrides` applied, built and validated. `path=None` means the demo's
  config (`default_config()`, what configs/demo.py returns): only for callers that document that default."""
  return build(apply_overrides(load_config_file(path) if path else default_config(), overrides))


def config_listing(path: str | None, overrides: dict[str, str]) -> str:
  """`--print-config`: every key with its value and one-line description (opdjax.config.descriptions). A config
  that is not runnable as it is (empty or missing paths before a pair is chosen) is still listed, its first
  check's complaint on the last line."""
  from opdjax.config.descriptions import describe
  from opdjax.config.schema import _build, flat

  values = apply_overrides(load_config_file(path) if path else default_config(), overrides).to_dict()
  with paths_unchecked():
    cfg = _build(Config, values, "")  # the sections' own value checks still apply
  try:
    build(values)
    problem = ""
  except ConfigError as e:
    problem = f"# not runnable as it is: {e}"
  rows = [(f"{k} = {v!r}", describe(k)) for k, v in flat(cfg.to_dict()).items()]
  width = min(max(len(a) for a, _ in rows), 60)
  return "\n".join([f"{a:<{width}}  # {d}" if d else a for a, d in rows] + ([problem] if problem else []))


@contextlib.contextmanager
def paths_unchecked():
  """Configs built inside do not check that the files they name exist: for commands that print
  what another machine will run (its paths are not this one's)."""
  token = CHECK_PATHS.set(False)
  try:
    yield
  finally:
    CHECK_PATHS.reset(token)
