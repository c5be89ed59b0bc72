"""Small host-side values shared across the processes of one multi-controller run (a few KiB of JSON
through JAX's own collectives): process 0's answer to every process, every process's to all, and
which processes share a host. Every process calls these at the same point of its program; in a single
process they return at once."""

from __future__ import annotations

import json
import socket

import jax
import numpy as np

BUFFER = 1 << 16  # bytes of JSON one call carries


def _encode(obj) -> np.ndarray:
  raw = json.dumps(obj).encode()
  if len(raw) > BUFFER:
    raise ValueError(f"{len(raw)} bytes of JSON to share across processes; at most {BUFFER}")
  buf = np.zeros(BUFFER, np.uint8)
  buf[:len(raw)] = np.frombuffer(raw, np.uint8)
  return buf


def _decode(buf) -> object:
  buf = np.asarray(buf)
  nz = np.flatnonzero(buf)
  return json.loads(bytes(buf[:int(nz[-1]) + 1]).decode()) if nz.size else None


def broadcast_json(obj):
  """Process 0's `obj` (JSON-able) on every process."""
  if jax.process_count() == 1:
    return obj
  from jax.experimental import multihost_utils

  return _decode(multihost_utils.broadcast_one_to_all(_encode(obj)))


def allgather_json(obj) -> list:
  """Every process's `obj`, by process index."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils

  every = np.asarray(multihost_utils.process_allgather(_encode(obj)))
  return [_decode(row) for row in every]


def hosts() -> list[list[int]]:
  """The processes of each host (by host name), hosts ordered by their first process."""
  names = allgather_json(socket.gethostname())
  order: dict[str, list[int]] = {}
  for i, name in enumerate(names):
    order.setdefault(name, []).append(i)
  return list(order.values())
