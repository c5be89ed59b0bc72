"""OPD vs GRPO under the same rollout configurations (mismatch levels): which one stays stable?

  python scripts/compare_opd_grpo.py --out runs/compare [--config.grpo.is_correction=tis ...]

Both start from the demo's SFT student and use the same engines, perturbations, prompts per step
(GRPO: rollout.batch_size completions in groups of grpo.group_size) and metrics. Per run:
held-out reverse KL to the teacher and verifier accuracy curves, grad norms, collapse yes/no and
grad-norm spikes (`opdjax.analyses.sweep.stability`). Writes OUT/compare.{json,md}, OUT/curves.png,
OUT/grad_norm.png; docs/admission.md records the result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from opdjax.analyses import admission, reporting
from opdjax.analyses.sweep import stability, sweep_config, train_run
from opdjax.config.resolve import resolve_config, split_overrides
from opdjax.pipeline.session import Session
from opdjax.views.view import EngineView

VIEWS = "clean;noise_sigma=0.2;noise_sigma=0.8;lag=4;lag=32"
# GRPO needs a start with some reward: the demo student after 400 SFT steps (greedy accuracy 0.24,
# sampled 0.08) rather than 100 (0.02, where GRPO's groups are almost all-zero). GRPO's learning
# rate: 3e-4 learns; 1e-3 and the OPD rate 5e-3 collapse even with the clean engine (docs/admission.md).
# Later --config.* flags override these.
DEFAULTS = ["--config.student.sft_steps=400", "--config.grpo.learning_rate=3e-4"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--config", help="configs/*.py (default: the demo's)")
  ap.add_argument("--views", default=VIEWS, help="';'-separated engine views")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--eval-every", type=int, default=25)
  ap.add_argument("--seeds", type=int, default=2)
  ap.add_argument("--algos", default="opd,grpo")
  args, extra = ap.parse_known_args(argv)
  cfg = sweep_config(resolve_config(args.config, split_overrides(DEFAULTS + extra)), args.steps, args.eval_every)
  views = admission.require_clean([EngineView.parse(v) for v in args.views.split(";")], f"--views={args.views!r}")
  runner = Session(cfg)
  load0, t0 = os.getloadavg()[0], time.time()
  algos = args.algos.split(",")
  runs, rows = {}, []
  for view in views:
    for algo in algos:
      for seed in range(args.seeds):
        records = train_run(runner, view, cfg.seed + seed, algo, desc=f"{algo} {view} seed {seed}")
        runs[f"{algo}|{view}|{seed}"] = records
        st = stability(records)
        last = records[-1]
        rows.append({"algo": algo, "view": str(view), "seed": seed, "final_accuracy": last.get("accuracy"),
                     "best_accuracy": st.best_accuracy, "final_reverse_kl": last["reverse_kl"],
                     "collapsed": st.collapsed, "grad_norm_spikes": st.grad_norm_spikes,
                     "max_grad_norm": st.max_grad_norm, "nonfinite_steps": st.nonfinite_steps,
                     "train_mismatch_kl_k3": float(np.mean([r["mismatch_kl_k3_tok"] for r in records[1:]]))})
        print(reporting.markdown_table([rows[-1]]), flush=True)
  os.makedirs(args.out, exist_ok=True)
  result = {"views": [str(v) for v in views], "algos": algos, "steps": args.steps, "seeds": args.seeds,
            "grpo": cfg.to_dict()["grpo"], "optim": cfg.to_dict()["optim"], "rows": rows, "runs": runs,
            "compiled": runner.compiled_counts(), "wall_s": round(time.time() - t0, 1),
            "commit": reporting.git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            "load_average": {"start": round(load0, 1), "end": round(os.getloadavg()[0], 1)},
            "argv": list(sys.argv[1:] if argv is None else argv),
            "stability_rule": ("collapse: final held-out accuracy < 0.5 x its best (best > 0.1) or a non-finite"
                               " step; spike: grad norm > 5 x the median of the previous 20 steps")}
  reporting.write_json(os.path.join(args.out, "compare.json"), result)
  reporting.write_text(os.path.join(args.out, "compare.md"), reporting.markdown_table(rows) + "\n")
  for metric, name in (("accuracy", "curves.png"), ("grad_norm", "grad_norm.png")):
    plot(result, os.path.join(args.out, name), metric)
  print(markdown(result) + ("\n\n" + counts(result) if set(algos) >= {"opd", "grpo"} else ""))
  return 0


def _runs(part: dict, algo: str, view: str) -> list[dict]:
  return sorted((x for x in part["rows"] if x["algo"] == algo and x["view"] == view), key=lambda x: x["seed"])


def start_accuracy(part: dict) -> float:
  """The held-out accuracy every run starts from (its step-0 evaluation: the SFT student)."""
  evals = ([r for r in recs if r.get("eval_step", 0) == r["step"]] for recs in part["runs"].values())
  return float(np.median([e[0]["accuracy"] for e in evals]))


def markdown(part: dict) -> str:
  """One row a view (its mismatch: the engine's k3 KL a token averaged over a run's steps, the median of the first
  algorithm's runs), per algorithm each seed's final accuracy, grad-norm spikes and collapse: docs/admission.md's
  tables and this script's printout."""
  cols = lambda xs, k, f="{:.3f}": ", ".join(f.format(x[k]) for x in xs)  # noqa: E731
  rows = []
  for view in part["views"]:
    by = [_runs(part, a, view) for a in part["algos"]]
    mismatch = np.median([x["train_mismatch_kl_k3"] for x in by[0]])
    rows.append([f"{view} ({mismatch:.2g})"] + [c for xs in by for c in (
        cols(xs, "final_accuracy"), cols(xs, "grad_norm_spikes", "{}"),
        ", ".join("**yes**" if x["collapsed"] else "no" for x in xs))])
  head = [f"{a.upper()} {c}" for a in part["algos"] for c in ("final accuracy", "spikes", "collapsed")]
  return reporting.markdown_table(rows, ["view (mismatch)", *head])


def counts(part: dict) -> str:
  """OPD's lowest final accuracy and its collapses; GRPO's runs that ended below the start, its collapses, and
  the views where it spiked most."""
  start = start_accuracy(part)
  opd, grpo = ([x for x in part["rows"] if x["algo"] == a] for a in ("opd", "grpo"))
  below = [x for x in grpo if x["final_accuracy"] < start]
  worst = max(grpo, key=lambda x: x["grad_norm_spikes"])
  return (f"OPD ended at accuracy {min(x['final_accuracy'] for x in opd):.3f} or above in all {len(opd)} runs and"
          f" collapsed in {sum(x['collapsed'] for x in opd)}; GRPO ended below the start ({start:.3f}) in {len(below)}"
          f" of {len(grpo)} runs ({', '.join(sorted({x['view'] for x in below})) or 'none'}) and collapsed in"
          f" {sum(x['collapsed'] for x in grpo)}; its most spikes were {worst['grad_norm_spikes']} of"
          f" {part['steps']} steps ({worst['view']}), against at most {max(x['grad_norm_spikes'] for x in opd)} for"
          " OPD")


def plot(result: dict, path: str, metric: str = "accuracy") -> str:
  """One panel a view: `metric` against the step, OPD blue and GRPO red, one line a seed (each of the run's
  records that carries the metric)."""
  colors = {"opd": "tab:blue", "grpo": "tab:red"}
  views, runs = result["views"], result["runs"]
  fig, axes = reporting.figure(1, len(views), figsize=(3.6 * len(views), 3.2), squeeze=False, sharey=True)
  for ax, view in zip(axes[0], views):
    for algo in result["algos"]:
      for s in range(result["seeds"]):
        recs = [r for r in runs[f"{algo}|{view}|{s}"] if metric in r]
        ax.plot([r["step"] for r in recs], [r[metric] for r in recs], color=colors.get(algo, "k"), alpha=0.8,
                lw=1, label=algo if s == 0 else None)
    ax.set_title(view, fontsize=8)
    ax.set_xlabel("step")
    if metric == "grad_norm":
      ax.set_yscale("log")
  axes[0][0].set_ylabel("held-out accuracy" if metric == "accuracy" else "grad norm (before clipping)")
  axes[0][0].legend(fontsize=7)
  reporting.save_figure(fig, path)
  return path


if __name__ == "__main__":
  sys.exit(main())
