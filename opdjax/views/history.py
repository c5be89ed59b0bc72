"""Staleness: the last few params versions, so an engine can sample with params exactly k steps old."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from opdjax.errors import UserError


class ParamsHistory:
  """The last `maxlen` params versions, so an engine can sample with params exactly k steps old.

  Versions are copied in (the train step donates its state), so the buffer costs `maxlen`
  copies of the params.
  """

  def __init__(self, maxlen: int):
    if maxlen < 1:
      raise UserError(f"staleness buffer needs maxlen >= 1, got {maxlen}.")
    self._buf: collections.deque[tuple[int, object]] = collections.deque(maxlen=maxlen)

  def push(self, version: int, params) -> None:
    self._buf.append((version, jax.tree.map(jnp.copy, params)))

  def lagged(self, lag: int) -> tuple[int, object]:
    """(version, params) from `lag` pushes ago; the oldest kept one while fewer exist."""
    if not self._buf:
      raise UserError("staleness buffer is empty: push the initial params first.")
    if lag >= self._buf.maxlen:
      raise UserError(f"lag {lag} needs a buffer of at least {lag + 1} versions (have maxlen={self._buf.maxlen}).")
    return self._buf[max(len(self._buf) - 1 - lag, 0)]

  def params(self) -> list:
    """The kept versions' params, oldest first (what a checkpoint saves)."""
    return [p for _, p in self._buf]

  def __len__(self):
    return len(self._buf)

  @property
  def versions(self) -> list[int]:
    return [v for v, _ in self._buf]
