"""How much of a step the two sides overlap: pure functions over a record's time split.

A timed or asynchronous step's record (opdjax.pipeline.loop.Timing) splits it into the generate side
(the producer's work: its part of the weight sync, `engine.generate`, the objective's inputs) and the
train side (`time_train_s`: the trainer's work, publishing the params included), and says how long
the trainer waited for the rollout. The trainer's step is its work plus its waiting; in a
synchronous step it waits for the whole generate side, so step = generate + train.

`overlap_efficiency = max(generate, train) / step`: 1.0 when the smaller side is hidden entirely
(the step takes only as long as its larger side, the limit of any overlap), generate and train over
their sum for a synchronous step. The busy fractions are each side's work over the step. A value a
little above 1 is measurement noise (the producer's stages are timed on its thread, the step on the
trainer's); it is kept, not clipped, so that a bias shows.
"""

from __future__ import annotations

import statistics

PRODUCER_STAGES = ("time_generate_s", "time_prepare_s")
FIELDS = ("overlap_efficiency", "busy_producer_frac", "busy_trainer_frac", "overlap_speedup_bound")


def generate_side(rec: dict) -> float:
  """The producer's work in a step: its part of the weight sync (`time_load_s` where the trainer
  exported, else the whole `time_weight_sync_s`), generation, the objective's inputs."""
  sync = rec.get("time_load_s", rec.get("time_weight_sync_s", 0.0))
  return sync + sum(rec.get(k, 0.0) for k in PRODUCER_STAGES)


def split(rec: dict) -> tuple[float, float, float]:
  """(generate side, train side, step time) of a timed record, in seconds."""
  g, t = generate_side(rec), rec["time_train_s"]
  wait = rec["time_queue_wait_s"] if "time_queue_wait_s" in rec else g  # synchronous: waits for all of it
  return g, t, t + wait


def efficiency(generate: float, train: float, step: float) -> float:
  return max(generate, train) / max(step, 1e-12)


def speedup_bound(generate: float, train: float) -> float:
  """What perfect overlap can gain over running the sides one after the other: (g + t) / max(g, t)."""
  return (generate + train) / max(generate, train, 1e-12)


def fields(rec: dict) -> dict:
  """The overlap fields of a timed record (what the loop adds to it)."""
  g, t, step = split(rec)
  s = max(step, 1e-12)
  return {"overlap_efficiency": round(efficiency(g, t, step), 4), "busy_producer_frac": round(g / s, 4),
          "busy_trainer_frac": round(t / s, 4), "overlap_speedup_bound": round(speedup_bound(g, t), 4)}


def summary(records: list[dict], skip: int = 1) -> dict:
  """Medians over the timed records after the first `skip` (compiles, the producer's first lead):
  each side's seconds, the step's, and the overlap fields."""
  timed = [r for r in records if "time_train_s" in r][skip:]
  if not timed:
    return {}
  splits = [split(r) for r in timed]
  out = {"steps": len(timed)}
  for i, name in enumerate(("generate_s", "train_s", "step_s")):
    out[name] = statistics.median(s[i] for s in splits)
  for k in FIELDS:
    out[k] = statistics.median(fields(r)[k] for r in timed)
  return out
