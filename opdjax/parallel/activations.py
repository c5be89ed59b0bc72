"""Sharding hints for activations: the residual stream's batch rows stay split over (data, fsdp).

Left to itself, XLA's sharding propagation meets batch rows sharded over fsdp and weights sharded
over fsdp in the same matmul, and may keep the weights split and gather the rows instead: every
device then holds the whole batch's activations (measured with `opdjax plan`: 8 devices, batch 64,
per-device temporaries larger than one device with batch 8). A constraint on the residual stream
at each layer settles it the FSDP way: weights are gathered, rows stay put.

The mesh reaches the model through a context variable that is set only while a function jitted
over a mesh is traced (`traced_on`), so the model takes no mesh argument and there is no global
mesh: outside such a trace `rows` is the identity.
"""

from __future__ import annotations

import contextvars
import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.parallel.mesh import BATCH_AXES

_MESH: contextvars.ContextVar = contextvars.ContextVar("opdjax_activation_mesh", default=None)


def rows(x):
  """`x` `[B, ...]` with its rows over the batch axes of the mesh being traced for (else `x`)."""
  mesh = _MESH.get()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(BATCH_AXES, *([None] * (x.ndim - 1)))))


def traced_on(fn, mesh):
  """`fn` that, while it runs (JAX traces it), lets `rows` constrain activations to `mesh`."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    token = _MESH.set(mesh)
    try:
      return fn(*args, **kwargs)
    finally:
      _MESH.reset(token)

  # A partial has no name to copy: its function's names the compiled program (jit_train_step, not jit_wrapped).
  wrapped.__name__ = wrapped.__qualname__ = getattr(fn, "__name__", getattr(getattr(fn, "func", None), "__name__",
                                                                             "wrapped"))
  return wrapped
