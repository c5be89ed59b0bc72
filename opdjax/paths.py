"""Names of parameter tensors, shared by the layers that select params by path (perturbations,
partition rules): the dotted module name of a tensor, with the scanned decoder's stacked layer axis
written out (`layers.3.mlp.down_proj`)."""

from __future__ import annotations

from collections.abc import Sequence

STACKED = "layers"  # params[STACKED] leaves hold one slice per decoder layer on axis 0


def module_path(keys: Sequence[str], layer: int | str | None = None) -> str:
  """('layers', 'mlp', 'down_proj', 'kernel'), layer 3 -> 'layers.3.mlp.down_proj'."""
  mods = list(keys[:-1])
  if mods and mods[0] == STACKED:
    mods.insert(1, str(layer))
  return ".".join(mods)
