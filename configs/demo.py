"""The offline CPU demo (what `opdjax demo` runs): full-vocabulary reverse KL."""

from opdjax.config.defaults import default_config


def get_config():
  return default_config()
