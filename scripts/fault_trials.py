"""Random SIGKILL trials: kill `opdjax train` at a random point, resume, compare with a clean run.

  PYTHONPATH=. python scripts/fault_trials.py --trials 20 [--steps 8] [--work DIR]

Each trial picks a phase (inside a rollout, inside a step, inside a checkpoint save) and a step at
random, runs with OPDJAX_FAULT=phase@step (the process SIGKILLs itself there), runs again into the
same folder (which resumes), and checks that the final student weights are bitwise equal to an
uninterrupted run and that metrics.jsonl holds every step exactly once with the same values.
Prints how many of N matched.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(out, steps, fault=None):
  env = {k: v for k, v in os.environ.items() if k != "OPDJAX_FAULT"}
  env["PYTHONPATH"] = ROOT
  if fault:
    env["OPDJAX_FAULT"] = fault
  args = ["--config", "configs/demo.py", f"--config.train.steps={steps}", "--config.train.checkpoint_every=2",
          "--config.train.eval_every=2", "--config.rollout.view=lag=1"]
  return subprocess.run([sys.executable, "-m", "opdjax.cli", "train", "--out", out, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True).returncode


def snapshot(out):
  weights = open(os.path.join(out, "student", "model.safetensors"), "rb").read()
  recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  for r in recs:
    r.pop("elapsed_s", None)
  return weights, recs


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--trials", type=int, default=10)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--work", default=None)
  a = ap.parse_args()
  work = a.work or tempfile.mkdtemp(prefix="opdjax-faults-")
  rng = random.Random(a.seed)
  assert train(os.path.join(work, "reference"), a.steps) == 0, "reference run failed"
  want = snapshot(os.path.join(work, "reference"))
  matched = 0
  for i in range(a.trials):
    fault = f"{rng.choice(['rollout', 'step', 'save'])}@{rng.randint(1, a.steps)}"
    if fault.startswith("save") and int(fault.split("@")[1]) % 2:
      fault = f"save@{int(fault.split('@')[1]) + 1 if int(fault.split('@')[1]) < a.steps else a.steps}"
    out = os.path.join(work, f"trial{i}")
    killed = train(out, a.steps, fault)
    resumed = train(out, a.steps)
    ok = killed == -9 and resumed == 0 and snapshot(out) == want
    matched += ok
    print(f"trial {i}: kill at {fault}: {'match' if ok else f'MISMATCH (rc {killed}, {resumed})'}", flush=True)
  print(f"{matched} of {a.trials} matched")
  return 0 if matched == a.trials else 1


if __name__ == "__main__":
  sys.exit(main())
