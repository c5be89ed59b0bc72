"""scripts/validate_schedule.py end to end at a tiny size: each layout's step predicted from another
run's costs only (never its own), and the table it prints (docs/async.md's) from the file it writes."""

import json

import pytest


@pytest.mark.slow
def test_every_layout_is_predicted_from_another_runs_costs(demo_cache, tmp_path, script):
  validate = script("validate_schedule")
  out = tmp_path / "sv"
  assert validate.main(["--out", str(out), "--steps", "6", "--warmup", "2", "--repeats", "1"]) == 0
  result = json.loads((out / "schedule_validation.json").read_text())
  rows = {r["layout"]: r for r in result["rows"]}
  want = {f"{p} {k}" for p in ("colocated", "disaggregated") for k in ("sync", "async k=1", "async k=2")}
  assert set(rows) == want
  runs = {r["layout"]: r for r in result["runs"]}
  for name, row in rows.items():
    assert row["costs_from"] != name and row["costs_from"].split()[0] == row["placement"]  # another run, same placement
    c = runs[row["costs_from"]]["costs"]
    producer, trainer = c["generate"] + c["prepare"] + c["load"], c["train"] + c["export"] + c["host"]
    want_s = producer + trainer if row["async_depth"] == 0 else max(producer, trainer)
    assert row["predicted_step_s"] == pytest.approx(want_s)
    assert row["measured_step_s"] == runs[name]["measured"]["step_s"] > 0
    assert row["error"] == pytest.approx(row["predicted_step_s"] / row["measured_step_s"] - 1)
    assert row["baseline_step_s"] == runs[row["costs_from"]]["measured"]["step_s"]
    assert len(row["load_1min"]) == 2
  # The script's table (docs/async.md renders the same) from this file: one line a layout, its error as written there.
  table = validate.markdown(result)
  for name, row in rows.items():
    line = next(x for x in table.splitlines() if x.startswith(f"| {name} |"))
    assert f"{100 * row['error']:+.0f}%" in line
