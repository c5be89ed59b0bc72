"""`opdjax plan --schedule` (opdjax.analyses.schedule): the schedule algebra against the event-by-event
simulation of the loop's rules, the costs read back from records that the algebra itself wrote (a
round trip of the algebra and the record parsing, not a validation: scripts/validate_schedule.py
predicts measured runs from other runs' costs), the modelled costs' scaling, and its errors."""

import json

import pytest

from opdjax import cli
from opdjax.analyses import schedule, schedule_model
from opdjax.analyses.capacity import load_model_config
from opdjax.errors import UserError
from opdjax.pipeline import overlap

TRAIN_BOUND = schedule.Costs(generate=3.3, prepare=1.0, load=0.5, train=7.4, export=0.5)  # the demo's split, ms
GEN_BOUND = schedule.Costs(generate=9.0, prepare=1.0, load=0.5, train=4.0, export=0.5)


def test_sync_is_the_sum_and_async_the_larger_side():
  assert schedule.sync_step(TRAIN_BOUND) == pytest.approx(3.3 + 1.0 + 0.5 + 7.4 + 0.5)
  assert schedule.async_step(TRAIN_BOUND, 1) == pytest.approx(7.9)  # t + x
  assert schedule.async_step(GEN_BOUND, 2) == pytest.approx(10.5)  # g + p + l
  assert schedule.async_step(GEN_BOUND, 0) == schedule.sync_step(GEN_BOUND)


@pytest.mark.parametrize("costs", [TRAIN_BOUND, GEN_BOUND], ids=["train-bound", "generation-bound"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_closed_form_is_the_simulated_loops_steady_state(costs, k):
  for mode in ("exact", "bounded"):
    assert schedule.simulate(costs, k, mode)["step_s"] == pytest.approx(schedule.async_step(costs, k))
  assert schedule.simulate(costs, k, "exact")["lag_mean"] == k  # exact: always k behind
  bounded = schedule.simulate(costs, k, "bounded")["lag_mean"]
  # Bounded: a fast producer runs ahead to the bound; a slow one samples the params published last.
  assert bounded == (k if costs is TRAIN_BOUND else 1)


def _records(costs: schedule.Costs, depth: int, steps: int = 12, jitter: float = 0.0, host: float = 0.0,
             ms: bool = False) -> list[dict]:
  """A run's records as opdjax.pipeline.loop.Timing writes them, for a step schedule that follows
  the costs (wall_s advancing by the step, plus `host` seconds of the loop's own a step that no
  stage times; `ms`: wall_s rounded to milliseconds, as the loop writes it), the first step slow
  (compiles)."""
  recs, wall = [{"step": 0}], 0.0
  for s in range(1, steps + 1):
    j = 1 + jitter * (-1) ** s
    c = schedule.Costs(*(v * j for v in (costs.generate, costs.train, costs.prepare, costs.load, costs.export)))
    if depth:
      step = schedule.async_step(c, depth)
      rec = {"time_generate_s": c.generate, "time_prepare_s": c.prepare, "time_load_s": c.load,
             "time_weight_sync_s": c.load + c.export, "time_publish_s": c.export, "time_train_s": c.trainer,
             "time_queue_wait_s": step - c.trainer, "time_producer_wait_s": step - c.producer}
    else:
      step = schedule.sync_step(c)
      rec = {"time_generate_s": c.generate, "time_prepare_s": c.prepare, "time_weight_sync_s": c.load + c.export,
             "time_train_s": c.train}
    wall += step * (20 if s == 1 else 1) + host
    rec.update(step=s, async_depth=depth, wall_s=round(wall, 3) if ms else wall)
    rec.update(overlap.fields(rec))
    recs.append(rec)
  return recs


def _write(tmp_path, name, recs):
  d = tmp_path / name
  d.mkdir()
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  return str(d)


@pytest.mark.parametrize("costs", [TRAIN_BOUND, GEN_BOUND], ids=["train-bound", "generation-bound"])
def test_costs_read_from_records_the_algebra_wrote_give_back_its_steps(tmp_path, costs):
  """Records written by `_records` from the algebra (+-5% jitter a step): the costs parsed from either
  kind give back the step the algebra wrote for both kinds, to the jitter. Records and prediction
  share the algebra, so this checks the parsing (the publish split out of time_train_s, the medians,
  the wall clock's slope) and the cross-kind bookkeeping, not that the algebra matches a real loop."""
  sync = _write(tmp_path, "sync", _records(costs, 0, jitter=0.05))
  async1 = _write(tmp_path, "async", _records(costs, 1, jitter=0.05))
  result = schedule.predict_measured([sync, async1], k=1)
  assert {(c["costs_of"], c["predicts"]) for c in result["checks"]} == {(sync, async1), (async1, sync)}
  written = {sync: schedule.sync_step(costs), async1: schedule.async_step(costs, 1)}
  for c in result["checks"]:
    assert c["measured_s"] == pytest.approx(written[c["predicts"]], rel=0.06), c  # the wall clock's slope
    assert c["predicted_s"] == pytest.approx(written[c["predicts"]], rel=0.06), c
  assert all(abs(r["predicted"]["own_step_error"]) < 0.06 for r in result["runs"])
  run = {r["path"]: r for r in result["runs"]}[async1]
  assert run["costs"]["export"] == pytest.approx(costs.export, rel=0.06)  # publish split out of time_train_s
  assert run["measured"]["overlap_efficiency"] == pytest.approx(1.0)
  assert run["predicted"]["speedup_async_over_sync"] == pytest.approx(schedule.sync_step(costs)
                                                                      / schedule.async_step(costs), rel=0.06)


def test_the_loops_host_time_outside_the_split_is_read_and_carried_to_the_other_kind(tmp_path):
  """The wall clock's step exceeds the split's by the loop's own host time (records, hooks); it is
  counted on the trainer's side, in both kinds (records written by the algebra, as above). Seconds in
  milliseconds (wall_s's resolution) over 200 steps still give each step to a few microseconds."""
  host, costs = 1.3e-3, schedule.Costs(generate=4.6e-3, prepare=0.2e-3, load=2.6e-3, train=14.8e-3)
  sync = _write(tmp_path, "sync", _records(costs, 0, steps=200, host=host, ms=True))
  async1 = _write(tmp_path, "async", _records(costs, 1, steps=200, host=host, ms=True))
  result = schedule.predict_measured([sync, async1], k=1)
  for run in result["runs"]:
    assert run["costs"]["host"] == pytest.approx(host, abs=2e-5)
    assert abs(run["predicted"]["own_step_error"]) < 0.01
  for c in result["checks"]:
    assert abs(c["error"]) < 0.01, c
  without = schedule.Costs(generate=4.6e-3, prepare=0.2e-3, load=2.6e-3, train=14.8e-3)  # what it was before
  assert schedule.async_step(without) / result["checks"][0 if result["checks"][0]["predicts"] == async1 else 1][
      "measured_s"] < 0.93  # leaving it out under-predicts the asynchronous step by the host time


def test_a_colocated_async_run_is_what_the_algebra_cannot_predict(tmp_path):
  """Both sides on the same cores (the demo once measured 12.5 ms a step against a max side of 7.9 ms),
  as records: the trainer's split absorbs the producer's share, so its costs are inflated and the
  record's overlap efficiency stays ~1 instead of showing a hidden side."""
  recs = _records(TRAIN_BOUND, 1)
  for r in recs[1:]:  # the trainer's step stretched by the producer taking its cores
    r["time_train_s"] *= 12.5 / 7.9
    r["time_queue_wait_s"] = 0.0
    r.update(overlap.fields(r))
  costs, measured = schedule.measured_costs(recs)
  assert measured["overlap_efficiency"] == pytest.approx(1.0)  # the trainer never waited: ...
  assert costs.train > 1.5 * TRAIN_BOUND.train  # ... its costs are inflated, not hidden


def test_measure_refuses_runs_without_a_time_split(tmp_path):
  plain = _write(tmp_path, "plain", [{"step": s, "loss": 1.0} for s in range(4)])
  with pytest.raises(UserError, match="no time split"):
    schedule.predict_measured([plain])
  with pytest.raises(UserError, match="no metrics.jsonl"):
    schedule.predict_measured([str(tmp_path / "missing")])


def test_modelled_costs_scale_with_devices_and_pick_the_best_split():
  t, s = load_model_config("qwen3-8b")[1], load_model_config("qwen3-1.7b")[1]
  lay = schedule_model.Layout(t, s, 16, "h100-sxm", batch=256, seq_len=4096, prompt_len=512)
  # The model cards: Qwen3-1.7B 1.7B parameters (1.4B without embeddings), Qwen3-8B 8.2B (6.95B).
  assert schedule_model.total_params(s) == pytest.approx(1.7e9, rel=0.03)
  assert schedule_model.total_params(s) - s.vocab_size * s.hidden_size == pytest.approx(1.4e9, rel=0.03)
  assert schedule_model.total_params(t) == pytest.approx(8.2e9, rel=0.03)
  assert schedule_model.train_seconds(lay, 8) == pytest.approx(2 * schedule_model.train_seconds(lay, 16))
  assert schedule_model.generate_seconds(lay, 8) < schedule_model.generate_seconds(lay, 4)
  fp8 = schedule_model.Layout(t, s, 16, "h100-sxm", batch=256, seq_len=4096, prompt_len=512, fp8=True)
  assert schedule_model.generate_seconds(fp8, 8) < 0.7 * schedule_model.generate_seconds(lay, 8)  # half the bytes read
  out = schedule_model.predict_modelled(lay, 1)
  best = out["best_async"]
  assert best["async_k1_s"] == min(sp["async_k1_s"] for sp in out["splits"])
  assert best["async_k1_s"] == pytest.approx(max(best["costs"]["generate"], best["costs"]["train"])
                                             + best["costs"]["load"])
  assert out["speedup_async_vs_sync_disaggregated"] > 1.3  # the sides are comparable at the best split
  assert "sync_colocated_s" in out


def test_layouts_that_do_not_fit_are_refused_naming_the_fix():
  with pytest.raises(UserError, match="needs about .* GiB a device.*more devices"):
    schedule_model.modelled("qwen3-8b", "qwen3-1.7b", devices=2, device="tpu-v5e", batch=64, seq_len=1024,
                      prompt_len=512)
  with pytest.raises(UserError, match="no FP8 matmuls"):
    schedule_model.modelled("qwen3-8b", "qwen3-1.7b", devices=16, device="tpu-v5e", batch=64, seq_len=1024,
                      prompt_len=512, fp8=True)
  with pytest.raises(UserError, match="--efficiency"):
    schedule_model.parse_efficiency("train=2")
  with pytest.raises(UserError, match="--rollout-devices 16"):
    schedule_model.modelled("qwen3-8b", "qwen3-1.7b", devices=16, device="h100-sxm", batch=64, seq_len=1024,
                      prompt_len=512, rollout_devices=16)


def test_the_cli_prints_the_prediction_and_writes_json(tmp_path, capsys):
  runs = [_write(tmp_path, "a", _records(GEN_BOUND, 1)), _write(tmp_path, "s", _records(GEN_BOUND, 0))]
  assert cli.main(["plan", "--schedule", "--measure", *runs, "--json", str(tmp_path / "m.json")]) == 0
  out = capsys.readouterr().out
  assert "costs predict" in out and json.loads((tmp_path / "m.json").read_text())["mode"] == "measured"
  assert cli.main(["plan", "--schedule", "--teacher", "qwen3-8b", "--student", "qwen3-1.7b", "--devices", "16",
                   "--batch", "256", "--seq-len", "4096", "--prompt-len", "512"]) == 0
  out = capsys.readouterr().out
  assert "best async k=1" in out and "vs sync disaggregated" in out and "vs sync colocated" in out
  assert cli.main(["plan", "--schedule"]) == 2  # no models, no runs: one error line


def test_fp8_speedups_are_inputs_with_their_source(tmp_path, capsys):
  """The planner cannot measure FP8 on CPU: a measured plan takes the speedup only with a source and
  prints it as an input; a modelled plan says its FP8 factor comes from the datasheet and an assumption."""
  runs = [_write(tmp_path, "a", _records(GEN_BOUND, 1)), _write(tmp_path, "s", _records(GEN_BOUND, 0))]
  assert cli.main(["plan", "--schedule", "--measure", *runs, "--fp8-generate-speedup", "1.6"]) == 2
  assert "--fp8-source" in capsys.readouterr().err
  assert cli.main(["plan", "--schedule", "--measure", *runs, "--fp8-generate-speedup", "1.6", "--fp8-source",
                   "a GPU benchmark", "--json", str(tmp_path / "m.json")]) == 0
  assert "input, not measured or predicted: FP8 generation x1.6 faster" in capsys.readouterr().out
  result = json.loads((tmp_path / "m.json").read_text())
  assert result["inputs"] == {"fp8_generate_speedup": {"value": 1.6, "source": "a GPU benchmark"}}
  plain = schedule.predict_measured(runs)
  fp8 = {r["path"]: r["costs"]["generate"] for r in result["runs"]}
  assert all(fp8[r["path"]] == pytest.approx(r["costs"]["generate"] / 1.6) for r in plain["runs"])
  assert cli.main(["plan", "--schedule", "--teacher", "qwen3-8b", "--student", "qwen3-1.7b", "--devices", "16",
                   "--batch", "256", "--seq-len", "4096", "--prompt-len", "512", "--fp8"]) == 0
  out = capsys.readouterr().out
  assert "input, not a prediction: FP8 generation x" in out and "datasheet" in out
