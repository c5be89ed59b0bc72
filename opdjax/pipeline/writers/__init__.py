"""Where a run's records go: every writer behind one interface (`Writer`: start, record, table, close), a
module per kind, one config key. `train.loggers` (comma-separated) selects them: `jsonl` (OUT/metrics.jsonl,
always written: resumes read it), `tensorboard` (OUT/tensorboard/), `wandb`, `trackio` (writers.trackers).
`train.log_samples_every` says how often a few samples go to OUT/samples.jsonl and to the writers' tables
(writers.samples). A new sink (MLflow, say) is a Writer in a module here and a name in KINDS and in
opdjax.config.train_section.LOGGERS."""

from __future__ import annotations

import os

from opdjax.config.train_section import parse_loggers
from opdjax.pipeline.writers.base import Writer
from opdjax.pipeline.writers.files import JsonlWriter, TensorBoardWriter
from opdjax.pipeline.writers.samples import SamplesWriter
from opdjax.pipeline.writers.trackers import TrackioWriter, WandbWriter, check_installed

KINDS = {"tensorboard": lambda out, cfg: TensorBoardWriter(os.path.join(out, "tensorboard")),
         "wandb": lambda out, cfg: WandbWriter(out, cfg.train.tracker_project, cfg.to_dict()),
         "trackio": lambda out, cfg: TrackioWriter(out, cfg.train.tracker_project, cfg.to_dict())}

__all__ = ["KINDS", "Writer", "check_installed", "run_writers"]


def run_writers(cfg, out_dir: str, resume_step: int, primary: bool) -> list[Writer]:
  """The writers `cfg.train` selects for a run into `out_dir` resumed at `resume_step` (-1: a fresh run).
  Process 0 (`primary`) alone writes; the samples writer runs on every process (a sharded rollout's rows
  are gathered by all of them) and writes on process 0."""
  out: list[Writer] = []
  if primary:
    out.append(JsonlWriter(os.path.join(out_dir, "metrics.jsonl"), resume_step))
    out += [KINDS[name](out_dir, cfg) for name in parse_loggers(cfg.train.loggers) if name != "jsonl"]
  if cfg.train.log_samples_every:
    out.append(SamplesWriter(os.path.join(out_dir, "samples.jsonl"), cfg.train.log_samples_every, resume_step,
                             write=primary))
  return out
