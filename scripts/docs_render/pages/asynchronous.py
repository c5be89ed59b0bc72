"""docs/async.md's and BENCHMARKS.md's figures: scripts/ttq_report.py's, scripts/validate_schedule.py's and
bench/core_split.py's own renderers."""

from __future__ import annotations

import os

from ..common import Figure, _read_json, bench, script


def plot_ttq(result: dict, path: str) -> str:
  """scripts/time_to_quality.py's own figure (imported here only: one drawing of the curves)."""
  before = os.environ.get("JAX_NUM_CPU_DEVICES")
  import time_to_quality  # sets JAX_NUM_CPU_DEVICES for its own runs: not for this process's children

  if before is None:
    os.environ.pop("JAX_NUM_CPU_DEVICES", None)
  return time_to_quality.plot(result["runs"], path)


FIGURES: dict[str, Figure] = {
    "ttq_best": Figure(("python scripts/time_to_quality.py --out {out}",), _read_json("time_to_quality.json"),
                       {"summary": script("ttq_report", "summary"), "table": script("ttq_report", "table")},
                       images=(("docs/figures/time_to_quality_best.png", plot_ttq),)),
    "schedule_validation": Figure(("python scripts/validate_schedule.py --engines jax,vllm --out {out}",),
                                  _read_json("schedule_validation.json"),
                                  {"table": script("validate_schedule", "markdown")}),
    "core_split": Figure(("python bench/core_split.py --json {out}/core_split.json",), _read_json("core_split.json"),
                         {"table": bench("core_split", "markdown")}, env={"PYTHONPATH": "."}),
}
