"""The demo's config as a locked ConfigDict: every key of `opdjax.config.schema.Config` with its
default. `configs/*.py` start from it and change values, never keys."""

from __future__ import annotations

import ml_collections

from opdjax.config.schema import Config


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(Config().to_dict())
  c.lock()  # configs may change these keys, never add new ones
  return c
