"""Overlap efficiency (opdjax.pipeline.overlap) on synthetic time splits, and the loop's Timing adding it."""

import time

import pytest

from opdjax.pipeline import overlap
from opdjax.pipeline.loop import Timing
from opdjax.pipeline.stages import Sample


def _async(g_gen, g_load, g_prep, train, wait):
  return {"time_generate_s": g_gen, "time_load_s": g_load, "time_weight_sync_s": g_load + 0.5,
          "time_prepare_s": g_prep, "time_train_s": train, "time_queue_wait_s": wait, "time_producer_wait_s": 0.1}


def test_a_synchronous_step_is_the_sum_of_its_sides():
  rec = {"time_weight_sync_s": 0.5, "time_generate_s": 3.3, "time_prepare_s": 1.0, "time_train_s": 7.9}
  g, t, step = overlap.split(rec)
  assert (g, t) == (pytest.approx(4.8), 7.9) and step == pytest.approx(12.7)
  f = overlap.fields(rec)
  assert f["overlap_efficiency"] == pytest.approx(7.9 / 12.7, abs=1e-4)
  assert f["busy_producer_frac"] + f["busy_trainer_frac"] == pytest.approx(1.0, abs=2e-4)
  assert f["overlap_speedup_bound"] == pytest.approx(12.7 / 7.9, abs=1e-4)


def test_an_asynchronous_step_hiding_the_smaller_side_is_efficiency_one():
  # The trainer (8 s of work) waits 0 for a producer busy 5 s: perfect overlap.
  f = overlap.fields(_async(3.0, 1.0, 1.0, 8.0, 0.0))
  assert f["overlap_efficiency"] == 1.0 and f["busy_trainer_frac"] == 1.0
  assert f["busy_producer_frac"] == pytest.approx(5 / 8)
  # The producer's load counts, not the trainer's export (time_weight_sync_s includes it).
  assert overlap.generate_side(_async(3.0, 1.0, 1.0, 8.0, 0.0)) == pytest.approx(5.0)


def test_a_generation_bound_asynchronous_step_is_limited_by_the_producer():
  # Producer 10 s a step, trainer 4 s of work waiting 6.5 s: the step is 10.5 s, 0.5 s not hidden.
  f = overlap.fields(_async(8.0, 1.0, 1.0, 4.0, 6.5))
  assert f["overlap_efficiency"] == pytest.approx(10 / 10.5, abs=1e-4)
  assert f["busy_producer_frac"] == pytest.approx(10 / 10.5, abs=1e-4)
  # The same sides one after the other would be 14 s: efficiency 10 / 14.
  sync = overlap.fields({"time_generate_s": 8.0, "time_weight_sync_s": 1.0, "time_prepare_s": 1.0,
                         "time_train_s": 4.0})
  assert sync["overlap_efficiency"] == pytest.approx(10 / 14, abs=1e-4)
  assert sync["overlap_efficiency"] < f["overlap_efficiency"]


def test_summary_takes_medians_after_the_warm_up_steps():
  recs = [{"step": 0}] + [_async(3.0, 1.0, 1.0, 8.0, w) for w in (30.0, 0.0, 2.0, 0.0)]
  s = overlap.summary(recs, skip=1)  # the 30 s first wait (compiles) is left out
  assert s["steps"] == 3 and s["train_s"] == 8.0 and s["step_s"] == 8.0 and s["generate_s"] == 5.0
  assert s["overlap_efficiency"] == 1.0
  assert overlap.summary([{"step": 0}]) == {}


def test_the_loops_timing_records_the_overlap_fields():
  """Timing.fields (opdjax.pipeline.loop) adds the overlap fields to its own split."""
  stats = {"time_load_s": 0.01, "time_weight_sync_s": 0.02, "time_generate_s": 0.03, "time_prepare_s": 0.01,
           "time_queue_wait_s": 0.0, "time_producer_wait_s": 0.0, "time_publish_s": 0.0}
  timing = Timing(Sample(None, [], None, dict, stats), step=3, depth=1, eval_s=0.0)
  time.sleep(0.1)
  timing.end(0.0)
  rec = timing.fields(0.0)
  assert rec["time_train_s"] >= 0.1
  assert rec["overlap_efficiency"] == pytest.approx(overlap.fields(rec)["overlap_efficiency"])
  assert rec["overlap_efficiency"] == 1.0  # the trainer never waited
  assert rec["busy_producer_frac"] == pytest.approx(0.05 / rec["time_train_s"], abs=1e-3)
