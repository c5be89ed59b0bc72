"""Pilot: does CLEAN `sampled_rkl` learn reliably on the addition task, and at which settings?

  python bench/sampled_pilot.py --out DIR [--steps 400] [--seeds 3] [--grid NAME=lr:baseline:student_term,...]
             [--views clean;noise_sigma=1.6] [--form trainer|rollout] [--config configs/smollm2_study.py]

SmolLM2's learn check for the sampled objective (the first run that decides its claim 1, docs/reproduction.md):
  python bench/sampled_pilot.py --config configs/smollm2_study.py --steps 10 --seeds 2 \
      --grid lr1.5e-5_loo=1.5e-5:loo:sampled,lr5e-5_loo=5e-5:loo:sampled --out DIR

Each grid point: one Session (the demo config, or --config's, with loss.kind=sampled_rkl and the point's
settings), `--seeds` runs per view (the loop `opdjax train` runs, as calibration does). Writes DIR/pilot.json
(per point and view: the final held-out reverse KL, accuracy and teacher-side measures (teacher_nll,
teacher_f1) per seed, the step-0 quality, wall seconds, load) after every point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


QUALITY = ("reverse_kl", "accuracy", "teacher_nll", "teacher_f1")


def quality(rec: dict) -> dict:
  return {k: rec[k] for k in QUALITY if k in rec}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--grid", default="lr5e-3=5e-3:none:sampled,lr2e-3_loo=2e-3:loo:sampled,"
                                    "lr1e-3_loo=1e-3:loo:sampled")
  ap.add_argument("--views", default="clean")
  ap.add_argument("--form", default="trainer")
  ap.add_argument("--kind", default="sampled_rkl")
  ap.add_argument("--config", default="", help="a configs/*.py (default: the demo's)")
  args = ap.parse_args(argv)
  from opdjax.analyses.sweep import sweep_config, train_run
  from opdjax.config.defaults import default_config
  from opdjax.config.loader import load_config_file
  from opdjax.config.schema import build
  from opdjax.pipeline.session import Session
  from opdjax.views.view import EngineView

  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "pilot.json")
  res = json.load(open(path)) if os.path.exists(path) else {}
  for item in args.grid.split(","):
    name, spec = item.split("=")
    lr, baseline, term = spec.split(":")
    if name in res and res[name].get("done"):
      continue
    c = (load_config_file(args.config) if args.config else default_config()).to_dict()
    c["loss"].update(kind=args.kind, baseline=baseline, student_term=term)
    c["loss"]["student_logprobs"] = args.form
    c["optim"]["learning_rate"] = float(lr)
    cfg = sweep_config(build(c), args.steps, args.steps)
    t0, load0 = time.time(), os.getloadavg()[0]
    session = Session(cfg, progress=False)
    point = {"lr": float(lr), "baseline": baseline, "student_term": term, "form": args.form, "views": {}}
    for v in args.views.split(";"):
      row = {k: [] for k in QUALITY}
      for s in range(args.seeds):
        recs = train_run(session, EngineView.parse(v), seed=s)
        row["start"] = quality(recs[0])
        for k, x in quality(recs[-1]).items():
          row[k].append(x)
        print(name, v, s, quality(recs[-1]), flush=True)
      point["views"][v] = row
    session.close()
    point.update(done=True, wall_s=round(time.time() - t0, 1), load=[round(load0, 2), round(os.getloadavg()[0], 2)])
    res[name] = point
    with open(path, "w") as f:
      json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
