"""opdjax: on-policy distillation in JAX. `opdjax.train(...)` is the Python API (opdjax.api); importing
the package loads nothing else (the API's modules import JAX on first use)."""

__all__ = ["Run", "train"]


def __getattr__(name: str):
  if name in __all__:
    from opdjax import api

    return getattr(api, name)
  raise AttributeError(f"module 'opdjax' has no attribute {name!r}")
