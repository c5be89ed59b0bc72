"""scripts/reproduce.py: the study end to end on tiny budgets (addition --quick), and its bad inputs."""

import json
import os

import pytest

from opdjax.analyses import reporting

COMMON = ("verdict", "label", "summary", "falsifier", "evidence", "pngs")  # from opdjax.analyses.verdicts
FIELDS = {
    "1": ("budget", "converged", "monotone", "points", "tolerance", "smallest_failing_mismatch", "extension", "power"),
    "2": ("recipe_kl", "edge_kl", "heldout", "kv_tokens_ratio", "top_layers", "recipe_weights"),
    "4": ("views", "prefix_shift_zero_when_shared", "noise_floor", "replicates"),
    "5": ("agree", "total", "false_accepts", "accepts", "rows"),
}


@pytest.fixture
def reproduce(script):
  return script("reproduce")


@pytest.mark.slow
def test_addition_quick_end_to_end(demo_cache, tmp_path, reproduce, capsys):
  out = tmp_path / "repro"
  assert reproduce.main(["--task", "addition", "--out", str(out), "--quick"]) == 0
  result = json.loads((out / "reproduction.json").read_text())
  assert set(result["claims"]) == {"1", "2", "4", "5"}
  for num, claim in result["claims"].items():
    assert claim["verdict"] in reproduce.VERDICTS, (num, claim["verdict"])
    for field in (*COMMON, *FIELDS[num]):
      assert field in claim, (num, field)
    for png in claim["pngs"]:
      assert (out / png).stat().st_size > 0, png
  assert set(result["stages"]) == {"calibrate", "sensitivity", "admission", "prefix_shift"}
  assert all(s["wall_s"] > 0 for s in result["stages"].values())
  # Two quick steps cannot learn: the forced budget says so, and claim 1 is not called either way.
  c1 = result["claims"]["1"]
  assert not c1["converged"] and c1["verdict"] == "inconclusive" and "did not improve" in c1["warning"]
  views = {p["view"] for p in c1["points"]}
  assert {"clean", "weights=fp8", "weights=int8"} <= views
  # No view failed clearly, so the calibration spent its run budget doubling the top noise (0.5 -> 1.0).
  assert c1["extension"] == {"max_runs": 10, "runs": 10, "added": ["noise_sigma=1.0"]} and "noise_sigma=1.0" in views
  # The seeds come from the clean pilot runs' spread, capped by the run budget (10 runs over 5 views: 2).
  assert c1["power"]["pilot_seeds"] == 2 and c1["power"]["seeds"] == 2 and c1["evidence"]["seeds"] == 2
  assert c1["power"]["rounds"][0]["max_seeds"] == 2 and c1["power"]["rounds"][0]["clean_seeds"] == 2
  assert result["design"] == {"run_budget": 10, "extra_views": 1, "replicates": 2}
  # 7 candidates, each admitted and trained; the counts add up; three noise levels placed around the budget.
  c5 = result["claims"]["5"]
  assert c5["total"] == len(c5["rows"]) == 7
  assert [r["name"].split("-")[1] for r in c5["rows"] if r["name"].startswith("noise-")] == ["below", "between",
                                                                                               "beyond"]
  # Nothing can degrade in two steps: accept-all would score every verdict right, so claim 5 is not called.
  assert c5["verdict"] == "inconclusive" and c5["evidence"]["accept_all"] == 7
  assert c5["agree"] == sum(r["agrees"] for r in c5["rows"])
  assert c5["false_accepts"] == [r["name"] for r in c5["rows"] if r["verdict"] == "accept" and not r["quality_ok"]]
  assert any(r["name"] == "fp8-recipe" and result["claims"]["2"]["recipe_weights"] in r["view"] for r in c5["rows"])
  # Prefix shift: the prefix-shift part is exactly zero before the first divergence (the analysis' own check).
  c4 = result["claims"]["4"]
  assert c4["prefix_shift_zero_when_shared"] and len(c4["views"]) == 2 and c4["replicates"] == 2
  assert all(len(v["prefix_shift"]) == 2 for v in c4["views"]) and len(c4["noise_floor"]["prefix_shift"]) == 2
  assert c4["evidence"]["replicates"] == 2
  # FP8 KV with one layer's KV in bf16: 2L/(L+1) the bf16 tokens (the tiny weights barely count).
  c2 = result["claims"]["2"]
  n = c2["num_layers"]
  assert c2["kv_bf16_layers"] == c2["top_layers"][:1]
  assert c2["kv_tokens_ratio"] == pytest.approx(2 * n / (n + 1), rel=0.01)
  assert c2["heldout"]["num_prompts"] == 8 and c2["heldout"]["recipe_kl"] >= 0  # the 8 eval prompts after the ranking's
  assert result["digest"] == reporting.record_digest(result)
  md = (out / "reproduction.md").read_text()
  assert "| claim | paper's statement | toy (addition) result | SmolLM2 result | holds? |" in md
  assert md.count("\n| ") >= 5 and "not run" in md  # the SmolLM2 column is empty in an addition-only run

  # The same command resumes: every stage is kept, nothing re-runs.
  capsys.readouterr()
  assert reproduce.main(["--task", "addition", "--out", str(out), "--quick"]) == 0
  again = json.loads((out / "reproduction.json").read_text())
  assert again["claims"]["1"]["budget"] == c1["budget"] and again["wall_s"] < result["wall_s"]
  # Another kind of run into the same --out is refused.
  assert reproduce.main(["--task", "addition", "--out", str(out)]) == 2
  assert "holds a reproduce run of task addition --quick" in capsys.readouterr().err


def test_unknown_task_is_an_argparse_error(reproduce, capsys):
  with pytest.raises(SystemExit) as e:
    reproduce.main(["--task", "mnist", "--out", "x"])
  assert e.value.code == 2
  assert "invalid choice: 'mnist'" in capsys.readouterr().err


def test_smollm2_missing_from_the_cache(reproduce, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("OPDJAX_CACHE", str(tmp_path / "empty-cache"))
  out = tmp_path / "out"
  assert reproduce.main(["--task", "smollm2", "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "opdjax models fetch smollm2-135m" in err
  assert not out.exists()  # checked before anything is written


def test_out_holding_another_run_is_refused(reproduce, tmp_path, capsys):
  out = tmp_path / "busy"
  out.mkdir()
  (out / "metrics.jsonl").write_text("{}\n")  # e.g. an `opdjax train` run
  assert reproduce.main(["--task", "addition", "--out", str(out), "--quick"]) == 2
  err = capsys.readouterr().err
  assert "is not empty" in err and "--overwrite" in err
  assert sorted(os.listdir(out)) == ["metrics.jsonl"]  # nothing written
  # An --out that is a file.
  f = tmp_path / "file"
  f.write_text("x")
  assert reproduce.main(["--task", "addition", "--out", str(f), "--quick"]) == 2
  assert "is a file" in capsys.readouterr().err
