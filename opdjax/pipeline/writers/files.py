"""The run's own files: OUT/metrics.jsonl (always written; resumes read it) and TensorBoard event files."""

from __future__ import annotations

import json

from opdjax.pipeline.loop import Loop
from opdjax.pipeline.writers.base import Writer, keep_until, numeric_fields


class JsonlWriter(Writer):
  """OUT/metrics.jsonl, one record per step. Resuming at step s keeps the records of steps <= s (a line cut
  by a crash is dropped), so every step is logged exactly once."""

  def __init__(self, path: str, resume_step: int | None):
    self.path, self.resume_step, self.file = path, resume_step, None

  def start(self, loop: Loop) -> None:
    if self.resume_step is not None:
      keep_until(self.path, self.resume_step)
    self.file = open(self.path, "a")

  def record(self, loop: Loop, rec: dict) -> None:
    self.file.write(json.dumps(rec) + "\n")
    self.file.flush()

  def close(self, loop: Loop) -> None:
    if self.file is not None:
      self.file.close()


class TensorBoardWriter(Writer):
  """TensorBoard event files under `logdir` (tensorboardX): every numeric field of every record, by step
  (held-out numbers at the step they were measured). A resume purges the events after its step."""

  def __init__(self, logdir: str):
    self.logdir, self.writer = logdir, None

  def start(self, loop: Loop) -> None:
    from tensorboardX import SummaryWriter

    self.writer = SummaryWriter(self.logdir, purge_step=loop.start_step + 1 if loop.start_step else None)

  def record(self, loop: Loop, rec: dict) -> None:
    for k, v in numeric_fields(loop, rec).items():
      self.writer.add_scalar(k, v, rec["step"])

  def close(self, loop: Loop) -> None:
    if self.writer is not None:
      self.writer.close()
