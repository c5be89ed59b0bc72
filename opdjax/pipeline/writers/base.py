"""The one interface of the run's writers (opdjax.pipeline.writers): where every record of a run goes."""

from __future__ import annotations

import json
import os

from opdjax.pipeline.loop import Hook, Loop


class Writer(Hook):
  """A sink of the run's record: `start(loop)` opens it (a resume from step s keeps what it had up to s),
  `record(loop, rec)` takes each step's final record, `table(step, rows)` a table of samples (a list of flat
  dicts; a sink without tables ignores it), `close(loop)` closes it, also on errors. Writers come after the
  guards in the run's hooks (opdjax.pipeline.hooks.assemble): a guard annotates the record they write."""

  def table(self, step: int, rows: list[dict]) -> None: ...


def carried_eval_keys(loop: Loop, rec: dict) -> set[str]:
  """The held-out keys `rec` carries from an evaluation of an earlier step (metrics.jsonl keeps them, with
  `eval_step` saying when they were measured); plots, trackers and progress lines show a held-out value only
  at the step it was measured."""
  if "eval_step" not in rec or rec["eval_step"] == rec["step"]:
    return set()
  return set(loop.last_eval or {}) | {"eval_step"}


def numeric_fields(loop: Loop, rec: dict) -> dict[str, float]:
  """The record's numbers as a tracker plots them: by step, held-out ones only where measured."""
  stale = carried_eval_keys(loop, rec)
  return {k: v for k, v in rec.items() if k != "step" and k not in stale and isinstance(v, (int, float))
          and not isinstance(v, bool)}


def keep_until(path: str, resume_step: int) -> None:
  """Cuts a JSONL file of step-ordered lines back to the lines of steps <= `resume_step` (a line cut by a
  crash ends it), so a resumed run writes every step once."""
  kept = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
          break
        if step > resume_step:
          break
        kept.append(line if line.endswith("\n") else line + "\n")
  with open(path + ".tmp", "w") as f:
    f.writelines(kept)
  os.replace(path + ".tmp", path)
