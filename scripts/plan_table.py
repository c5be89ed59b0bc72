"""The measured table of docs/scaling.md: `opdjax plan` for Qwen3 teacher -> student pairs on 1, 8 and 16
devices, a few meshes each, at configs/qwen3_1p7b_to_0p6b.py's workload (batch 64 x 1024 tokens, prompt
512, sampled_rkl with 128-position chunks, bf16 compute, full remat).

Every result is appended to a JSON-lines file as it lands (a rerun skips what is there), one compile at
a time, so the shared CPU is never asked for more than one compile:

    PYTHONPATH=. python scripts/plan_table.py --out docs/scaling_results.jsonl   # ~1-3 min a plan
    PYTHONPATH=. python scripts/plan_table.py --out docs/scaling_results.jsonl --markdown
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from opdjax.analyses.plan import GIB, Plan, run

PAIRS = [("qwen3-1.7b", "qwen3-0.6b"), ("qwen3-4b", "qwen3-1.7b"), ("qwen3-8b", "qwen3-1.7b"),
         ("qwen3-8b", "qwen3-4b")]
MESHES = {1: [(1, 1, 1)], 8: [(1, 8, 1), (2, 4, 1), (1, 4, 2)], 16: [(1, 16, 1), (2, 8, 1), (1, 8, 2)]}
COMMON = dict(loss="sampled_rkl", chunk=128, dtype="bfloat16", remat="full")
# The second workload is measured but not tabled: at 4096 tokens the CPU compile's attention keeps
# [rows, heads, T, T] fp32 scores per layer, which a GPU's fused attention never holds (docs/scaling.md).
WORKLOADS = [dict(batch=64, seq_len=1024, prompt_len=512, **COMMON),  # configs/qwen3_1p7b_to_0p6b.py
             dict(batch=256, seq_len=4096, prompt_len=1024, **COMMON)]  # long reasoning rollouts
HBM = {"H100": 80, "H200": 141}
HEADROOM = 0.9


def plans():
  for workload in WORKLOADS:
    for teacher, student in PAIRS:
      for devices, meshes in MESHES.items():
        for mesh in meshes:
          yield Plan(teacher, student, devices, mesh, **workload)


def _key(p: dict) -> tuple:
  return (p["batch"], p["seq_len"], p["teacher"], p["student"], p["devices"], tuple(p["mesh"]))


def measure_all(path: str) -> None:
  done = set()
  if os.path.exists(path):
    with open(path) as f:
      done = {_key(json.loads(line)["plan"]) for line in f if line.strip()}
  for plan in plans():
    if _key(dataclasses.asdict(plan)) in done:
      continue
    t = time.time()
    try:
      result = run(plan, timeout_s=3600)
    except Exception as e:  # noqa: BLE001 -- recorded, the table says why a cell is empty
      result = {"plan": dataclasses.asdict(plan), "error": str(e)}
    result["wall_s"] = round(time.time() - t, 1)
    with open(path, "a") as f:
      f.write(json.dumps(result) + "\n")
    print(f"{plan.teacher} -> {plan.student} {plan.devices} dev mesh {plan.mesh}: {result.get('error') or 'ok'}"
          f" ({result['wall_s']} s)", file=sys.stderr, flush=True)


def _gib(x: float) -> str:
  return f"{x / GIB:.1f}"


def recommend(rows: list[dict], hbm: float, node_gpus: int = 8) -> dict | None:
  """The mesh to use: the first that fits `hbm` x HEADROOM of, in order, fsdp over one node's GPUs and
  data across nodes (FSDP's all-gathers and reduce-scatters stay on the node's NVLink; only the
  gradient all-reduce of the data axis crosses nodes), fsdp over every device, then tensor
  parallelism; None when none fits."""
  ok = {tuple(r["plan"]["mesh"]): r for r in rows if "error" not in r and _peak(r) <= hbm * GIB * HEADROOM}
  n = rows[0]["plan"]["devices"]
  prefer = [(max(n // node_gpus, 1), min(n, node_gpus), 1), (1, n, 1)]
  for mesh in prefer + sorted(ok, key=lambda m: (m[2], _peak(ok[m]))):
    if mesh in ok:
      return ok[mesh]
  return None


def _peak(r: dict) -> float:
  return max(r["train"]["peak"], r["rollout"]["peak"])


def markdown(path: str) -> str:
  with open(path) as f:
    return markdown_of([json.loads(line) for line in f if line.strip()])


def markdown_of(results: list[dict]) -> str:
  """The tables of docs/scaling.md (scripts/docs.py renders them from docs/results/scaling.json)."""
  parts = []
  for w in WORKLOADS[:1]:
    rows = [r for r in results if (r["plan"]["batch"], r["plan"]["seq_len"]) == (w["batch"], w["seq_len"])]
    if rows:
      parts.append(f"Batch {w['batch']} x {w['seq_len']} tokens (prompt {w['prompt_len']}), {w['loss']}, chunk"
                   f" {w['chunk']}, {w['dtype']}, remat {w['remat']}; GiB per device:\n\n" + _tables(rows))
  return "\n\n".join(parts)


def _tables(results: list[dict]) -> str:
  out = ["| teacher -> student | devices | mesh (data x fsdp x tensor) | student + opt state | teacher | train temps |"
         " train peak | rollout peak | H100 80 GiB | H200 141 GiB | compile s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  by_group: dict = {}
  for r in results:
    p = r["plan"]
    by_group.setdefault((p["teacher"], p["student"], p["devices"]), []).append(r)
    mesh = "x".join(str(x) for x in p["mesh"])
    name = f"{p['teacher']} -> {p['student']}"
    if "error" in r:
      out.append(f"| {name} | {p['devices']} | {mesh} | error: {r['error'][:80]} | | | | | | | |")
      continue
    t, ro = r["train"], r["rollout"]
    fit = {g: ("yes" if _peak(r) <= hbm * GIB * HEADROOM else "no") for g, hbm in HBM.items()}
    out.append(f"| {name} | {p['devices']} | {mesh} | {_gib(t['student_params'] + t['optimizer_state'])} |"
               f" {_gib(t['teacher_params'])} | {_gib(t['temporaries'])} | {_gib(t['peak'])} | {_gib(ro['peak'])} |"
               f" {fit['H100']} | {fit['H200']} | {r['compile_s']['train'] + r['compile_s']['rollout']:.0f} |")
  rec = ["", "| teacher -> student | devices | recommended mesh, H100 | recommended mesh, H200 |", "|---|---|---|---|"]
  for (teacher, student, devices), rows in by_group.items():
    cells = []
    for hbm in HBM.values():
      best = recommend(rows, hbm)
      cells.append("none fits" if best is None else
                   "x".join(str(best["mesh_sizes"][a]) for a in ("data", "fsdp", "tensor"))
                   + f" ({_gib(_peak(best))} GiB)")
    rec.append(f"| {teacher} -> {student} | {devices} | {cells[0]} | {cells[1]} |")
  return "\n".join(out + rec)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="docs/scaling_results.jsonl")
  ap.add_argument("--markdown", action="store_true", help="print the tables from --out and stop (first workload)")
  args = ap.parse_args()
  if args.markdown:
    print(markdown(args.out))
  else:
    measure_all(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
