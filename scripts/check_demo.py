"""Fails (exit 1) unless a demo run learned: final held-out accuracy >= 0.95 and held-out reverse KL
down at least 10x from step 0. CI runs it on the README's demo, so a regression of the main job fails CI.

  python scripts/check_demo.py runs/demo/metrics.jsonl
"""

import json
import sys


def main(path: str, min_accuracy: float = 0.95, min_kl_drop: float = 10.0) -> int:
  recs = [json.loads(line) for line in open(path)]
  first, last = recs[0], recs[-1]
  drop = first["reverse_kl"] / max(last["reverse_kl"], 1e-12)
  print(f"demo: step {last['step']}: held-out reverse KL {first['reverse_kl']:.4f} -> {last['reverse_kl']:.4f}"
        f" ({drop:.0f}x down), accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f}")
  if last["accuracy"] < min_accuracy or drop < min_kl_drop:
    print(f"demo did not learn: need accuracy >= {min_accuracy} and reverse KL down >= {min_kl_drop}x",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
