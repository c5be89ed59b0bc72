"""Fails (exit 1) unless a demo run learned: final held-out accuracy >= 0.95 and held-out reverse KL
down at least 10x from step 0. CI runs it on the README's demo, so a regression of the main job fails CI.

  python scripts/check_demo.py runs/demo                  # the run folder (--out) ...
  python scripts/check_demo.py runs/demo/metrics.jsonl    # ... or its metrics file
"""

import argparse
import json
import os
import sys


def load_records(path: str) -> list[dict]:
  """The metrics.jsonl of a run folder, or the file itself; a missing or empty one is a clear error."""
  file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise SystemExit(f"check_demo: {file} does not exist; pass the demo's --out folder or its metrics.jsonl")
  recs = [json.loads(line) for line in open(file) if line.strip()]
  if not recs:
    raise SystemExit(f"check_demo: {file} holds no records (did the run start?)")
  return recs


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("run", help="the demo's --out folder, or its metrics.jsonl")
  ap.add_argument("--min-accuracy", type=float, default=0.95, help="final held-out accuracy needed (0.95)")
  ap.add_argument("--min-kl-drop", type=float, default=10.0, help="step-0 / final held-out reverse KL needed (10)")
  args = ap.parse_args(argv)
  recs = load_records(args.run)
  first, last = recs[0], recs[-1]
  drop = first["reverse_kl"] / max(last["reverse_kl"], 1e-12)
  print(f"demo: step {last['step']}: held-out reverse KL {first['reverse_kl']:.4f} -> {last['reverse_kl']:.4f}"
        f" ({drop:.0f}x down), accuracy {first['accuracy']:.4f} -> {last['accuracy']:.4f}")
  if last["accuracy"] < args.min_accuracy or drop < args.min_kl_drop:
    print(f"demo did not learn: need accuracy >= {args.min_accuracy} and reverse KL down >= {args.min_kl_drop}x",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
