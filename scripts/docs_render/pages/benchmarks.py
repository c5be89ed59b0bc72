"""BENCHMARKS.md's figures: each view is its bench's own renderer (bench/NAME.py), the one its printout uses."""

from __future__ import annotations

import json
import os

from ..common import Figure, _bench_module, _read_json, bench


def collect_decode_profile(out: str) -> dict:
  """bench/decode_profile.py's JSON, its trace's kernels summed again from the trace it wrote (a run before the
  bench summed them by kind has its kinds too)."""
  rep = json.load(open(os.path.join(out, "decode_profile.json")))
  trace = os.path.join(out, "decode_profile_trace.json.gz")
  if os.path.isfile(trace):
    ops = _bench_module("decode_profile").device_ops(trace)
    ops.pop("file", None)
    rep["profile"].update(ops)
  return rep


def _engine_versions(r: dict) -> str:
  ev, res = _bench_module("engine_versions"), r["result"]
  return "\n".join([ev.markdown(res), "", *ev.summary_lines(res)])


FIGURES: dict[str, Figure] = {
    "decode_profile": Figure(("PYTHONPATH=. python bench/decode_profile.py --mode gpu",), collect_decode_profile,
                             {"section": bench("decode_profile", "markdown")},
                             note="run on the lent H200 through the session's device tool (python3, the image's"
                                  " CUDA jax), from commit d2e29b2's tree with bench/decode_profile.py added (its"
                                  " measuring code as committed in 3d479b9); the folder it wrote read with --refresh"
                                  " decode_profile --from at the commit below, which sums the trace's kernels"),
    "decode_profile_layers": Figure(
        ("PYTHONPATH=. OUT=DIR/scan python bench/decode_profile.py --mode gpu --batch-factors 1",
         "PYTHONPATH=. OUT=DIR/unrolled python bench/decode_profile.py --mode gpu --batch-factors 1 --unroll-layers"),
        lambda out: {v: collect_decode_profile(os.path.join(out, v)) for v in ("scan", "unrolled")},
        {"table": bench("decode_profile", "layers_table")},
        note="one call on the lent H200 (python3, the image's CUDA jax), from commit 4d3a605's tree with"
             " --batch-factors and --unroll-layers added; the folder read with --refresh decode_profile_layers --from"
             " at the commit below, which sums each trace's kernels"),
    "engine_versions": Figure(("python bench/engine_versions.py --before 5daaaa2 --out {out}/engine_versions.json",),
                              _read_json("engine_versions.json"),
                              {"setup": lambda r: "\n".join(_bench_module("engine_versions").setup_lines(r["result"])),
                               "table": _engine_versions},
                              env={"PYTHONPATH": "."},
                              note="5daaaa2: the commit before e03a96c, which brought the per-layer KV cache and"
                                   " weights prepared once per version"),
    "gpu_suite": Figure(("bash bench/gpu_suite.sh --budget 540",), _read_json("gpu_suite.json"),
                        {"section": lambda r: _bench_module("gpu_suite").markdown(r["result"], title=False).strip("\n"),
                         "decode_floor": bench("decode_profile", "floor")},
                        note="run on the lent H200 through the session's device tool (PYTHON=python3, the image's"
                             " CUDA jax and torch), from commit bd689b6's tree with the --budget flag that d2e29b2"
                             " committed; the folder it wrote read with --refresh gpu_suite --from at the commit"
                             " below"),
    "weight_sync": Figure(("python bench/weight_sync.py --out {out}/weight_sync.json",), _read_json("weight_sync.json"),
                          {"section": bench("weight_sync", "markdown"), "line": bench("weight_sync", "line")},
                          env={"PYTHONPATH": "."}),
    "served_teacher": Figure(("python bench/served_teacher.py --out {out}/served_teacher.json",),
                             _read_json("served_teacher.json"), {"table": bench("served_teacher", "markdown")},
                             env={"PYTHONPATH": "."}),
}
