"""Experiment trackers of a run (`train.loggers`): W&B and trackio, writers beside metrics.jsonl and TensorBoard.

Every tracker gets every numeric field of every record by step (held-out numbers only at the step they
were measured), the run's config once, with the commit of the opdjax source that ran (`opdjax_commit`),
and the sample tables of opdjax.pipeline.writers.samples.SamplesWriter. Neither W&B nor trackio is a
dependency: `pip install 'opdjax[trackers]'`; asking for one that is not installed is one error before --out
is touched. Only process 0 logs. W&B honours its own environment (WANDB_MODE=offline writes the run under
OUT/wandb/ for `wandb sync`); trackio writes its local store (TRACKIO_DIR, default
~/.cache/huggingface/trackio; `trackio show` opens it).

Both runs are named by the run's identity (`run_identity`: --out's absolute path and the first start), never
by the folder's name alone. On a resume from step s, W&B is rewound to s (`resume_from`); trackio has no
rewind: it resumes the run by name and appends, so its store holds both the abandoned attempt's rows for the
steps after s and the re-run's (a step's last row is the re-run's; metrics.jsonl holds only the re-run).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess

from opdjax.config.train_section import parse_loggers
from opdjax.errors import UserError
from opdjax.pipeline.loop import Loop
from opdjax.pipeline.writers.base import Writer, numeric_fields

PACKAGES = {"wandb": "wandb", "trackio": "trackio"}


def check_installed(spec: str) -> None:
  """One line naming the extra for a tracker that is not installed (before anything is written)."""
  for name in parse_loggers(spec):
    pkg = PACKAGES.get(name)
    if pkg and importlib.util.find_spec(pkg) is None:
      raise UserError(f"train.loggers has {name!r}, but {pkg} is not installed: pip install 'opdjax[trackers]' (or"
                      f" pip install {pkg}), or drop {name!r} from train.loggers.")


def source_commit() -> str:
  """The git commit of the opdjax source that runs ('+dirty' with uncommitted changes; '' outside a checkout)."""
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))  # opdjax/pipeline/writers/
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    if head.returncode:
      return ""
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, timeout=10)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
  except (OSError, subprocess.SubprocessError):
    return ""


def run_identity(out_dir: str) -> str:
  """A run's identity: its --out absolute path and its first start (the first entry of OUT/config_history.jsonl,
  which train writes before the trackers start), hashed. A resume keeps it; a new run in the same path does not."""
  first = ""
  try:
    with open(os.path.join(out_dir, "config_history.jsonl")) as f:
      first = json.loads(f.readline()).get("time", "")
  except (OSError, ValueError):
    pass
  return hashlib.sha1(f"{os.path.abspath(out_dir)}\n{first}".encode()).hexdigest()[:16]


class Tracker(Writer):
  """A tracker run opened at `start` with the config, fed each record, closed at `close`."""

  def __init__(self, out_dir: str, project: str, config: dict):
    self.out_dir, self.project = out_dir, project
    self.run_id = run_identity(out_dir)
    # The name trackio resumes by (and W&B shows): the folder's name, made unique by the run's identity, so
    # `--out a/run` and `--out b/run` are two runs, and a new run in a reused path another.
    self.name = f"{os.path.basename(os.path.abspath(out_dir))}-{self.run_id[:8]}"
    self.config = {**config, "opdjax_commit": source_commit(), "out": os.path.abspath(out_dir)}
    self.run = None


class WandbWriter(Tracker):
  def start(self, loop: Loop) -> None:
    import wandb

    self.wandb = wandb
    # A resume rewinds the W&B run to the checkpoint's step (`resume_from`; offline runs record it and the rewind
    # happens at `wandb sync`): the re-run steps replace the abandoned attempt's, which W&B would otherwise keep
    # (it ignores steps below its last logged one).
    where = {"resume_from": f"{self.run_id}?_step={loop.start_step}"} if loop.start_step else {"resume": "allow"}
    self.run = wandb.init(project=self.project, name=self.name, id=self.run_id, dir=self.out_dir, config=self.config,
                          **where)

  def record(self, loop: Loop, rec: dict) -> None:
    self.run.log(numeric_fields(loop, rec), step=rec["step"])

  def table(self, step: int, rows: list[dict]) -> None:
    if rows:
      cols = list(rows[0])
      self.run.log({"samples": self.wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])}, step=step)

  def close(self, loop: Loop) -> None:
    if self.run is not None:
      self.run.finish()
      self.run = None


class TrackioWriter(Tracker):
  def start(self, loop: Loop) -> None:
    import trackio

    self.trackio = trackio
    self.run = trackio.init(project=self.project, name=self.name, config=self.config, resume="allow")

  def record(self, loop: Loop, rec: dict) -> None:
    self.trackio.log(numeric_fields(loop, rec), step=rec["step"])

  def table(self, step: int, rows: list[dict]) -> None:
    if rows and hasattr(self.trackio, "Table"):
      import pandas as pd

      self.trackio.log({"samples": self.trackio.Table(dataframe=pd.DataFrame(rows))}, step=step)

  def close(self, loop: Loop) -> None:
    if self.run is not None:
      self.trackio.finish()
      self.run = None
