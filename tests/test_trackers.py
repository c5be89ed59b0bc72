"""Tracker runs named by the run's identity (--out's absolute path and first start), never the folder's name."""

import json

from opdjax.pipeline.writers.trackers import TrackioWriter, WandbWriter, run_identity


def _start(out, time):
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "config_history.jsonl", "a") as f:
    f.write(json.dumps({"time": time, "start_step": 0}) + "\n")


def test_same_folder_names_in_two_parents_are_two_runs_and_a_resume_is_the_same(tmp_path):
  a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
  _start(a, "2026-12-06T05:00:00+00:00")
  _start(b, "2026-12-06T05:00:00+00:00")
  ta, tb = TrackioWriter(str(a), "p", {}), TrackioWriter(str(b), "p", {})
  assert ta.name != tb.name and ta.run_id != tb.run_id and ta.name.startswith("run-")
  assert WandbWriter(str(a), "p", {}).run_id == ta.run_id
  _start(a, "2026-12-06T06:00:00+00:00")  # a resume appends; the first start stays
  assert TrackioWriter(str(a), "p", {}).name == ta.name
  again = tmp_path / "again" / "run"  # a new run in a reused path: another identity
  _start(again, "2026-12-06T07:00:00+00:00")
  first = run_identity(str(again))
  (again / "config_history.jsonl").unlink()
  _start(again, "2026-12-06T08:00:00+00:00")
  assert run_identity(str(again)) != first
