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
  assert set(result["stages"]) == {"calibrate", "sensitivity", "admission", "prefix_shift", "forms"}
  # Claim 1 on the sampled objective with the trainer's log-probs; the contrast forms beside it, each its own
  # calibration folder and verdict by the same rule.
  assert result["claims"]["1"]["form"].startswith("sampled_rkl (student log-probs: trainer")
  assert set(result["forms"]) == {"engine_logprobs", "full_rkl"}
  for name, f in result["forms"].items():
    assert f["verdict"] in reproduce.VERDICTS and f["evidence"]["views"] and f["overrides"], name
    assert (out / f"calibration_{name}" / "budget.json").stat().st_size > 0
  assert result["forms"]["engine_logprobs"]["form"].startswith("sampled_rkl, advantage from the engine's")
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
  assert c4["evidence"]["replicates"] == 2 and c4["evidence"]["floor_kind"] == "same seed"
  assert c4["noise_floor"]["prefix_shift"] == [0.0, 0.0]  # the same stream: the view alone is above it
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


# --- the GPU profile -------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


KEEP = "0,3"  # the toy SmolLM2's student: its middle layers 1-2 dropped


@pytest.fixture(scope="module")
def tiny_smollm2_cache(tmp_path_factory):
  """An OPDJAX_CACHE whose `fetch:smollm2-135m` is SmolLM2-135M-Instruct's shape at toy width and depth: 4 llama
  layers (the dry run's student keeps 2 of them, `KEEP`: the study's 20 of 30 unrolled cost 175 of the suite's
  CPU-s; an engine's decode step runs its layers unrolled, so its compile grows with each one), tied embeddings,
  random weights, its chat markers, and a byte-level BPE trained here on the study's prompts (nothing downloaded)."""
  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  from opdjax.models.fetch import model_dir

  root = tmp_path_factory.mktemp("smollm2-cache")
  path = model_dir("smollm2-135m", str(root))
  os.makedirs(path)
  data = os.path.join(os.path.dirname(reporting.__file__), "..", "data", "chat_instructions.jsonl")
  with open(data) as f:
    texts = [json.loads(line)["prompt"] for line in f if line.strip()]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts + ["system user assistant You are a helpful AI assistant"] * 4, trainers.BpeTrainer(
      vocab_size=1024, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                              pad_token="<|im_end|>", unk_token="<|endoftext|>")
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(path)
  cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=512)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(cfg).save_pretrained(path)
  with open(os.path.join(path, "SOURCE.json"), "w") as f:
    json.dump({"name": "smollm2-135m", "model": "tests/test_reproduce.py: random weights at toy width"}, f)
  return str(root)


def test_gpu_estimate_fits_one_lease(reproduce):
  est = reproduce.gpu_estimate()
  assert est["total_s"] <= est["limit_s"] == 540  # 9 of the lease's 15 minutes
  # The docstring's arithmetic: 32 tokens x 4.82 ms x 20/28 layers; 1.2 TFLOP a train step, budgeted at 30 ms.
  assert est["rollout_s"] == pytest.approx(0.110, abs=5e-4) and est["train_flops"] == pytest.approx(1.21e12, rel=0.01)
  assert est["run_s"] == pytest.approx(3.78, abs=0.01) and est["runs"] == 76
  assert f"{est['total_s']:.0f} s" in reproduce.__doc__ and f"{est['total_s'] / 60:.1f} min" in reproduce.__doc__
  # The design the estimate counts: 24 steps of 16 prompts, 4 pilot seeds, 48 calibration runs, 7 candidates.
  full = reproduce.design("smollm2", "gpu", False)
  b = full["budgets"]
  assert (b["calibrate.steps"], b["rollout.batch_size"], b["calibrate.seeds"], full["run_budget"]) == (24, 16, 4, 48)
  assert b["sensitivity.num_prompts"] > 8  # claim 2's interval
  cfg = reproduce.build_config("smollm2", False, "gpu")  # the full-size config builds and checks
  assert cfg.calibrate.steps == cfg.train.steps == cfg.optim.total_steps == 24 and cfg.calibrate.tolerance_rel == 0.005
  with pytest.raises(reproduce.ReproduceError, match="sized for --task smollm2"):
    reproduce.design("addition", "gpu", False)


@pytest.mark.slow
def test_gpu_profile_dry_run_on_cpu(tiny_smollm2_cache, tmp_path, reproduce, capsys, monkeypatch):
  monkeypatch.setenv("OPDJAX_CACHE", tiny_smollm2_cache)
  dry = reproduce.GPU_DESIGN[("smollm2", True)]  # the study's middle layers dropped, as in configs/smollm2_study.py
  monkeypatch.setitem(dry, "budgets", {**dry["budgets"], "student.keep_layers": KEEP})
  out = tmp_path / "gpu"
  # The full profile refuses a machine without a GPU before anything is written.
  assert reproduce.main(["--task", "smollm2", "--profile", "gpu", "--out", str(out)]) == 2
  assert "--profile gpu is sized for one H200" in capsys.readouterr().err and not out.exists()
  assert reproduce.main(["--task", "smollm2", "--profile", "gpu", "--quick", "--out", str(out)]) == 0
  result = json.loads((out / "reproduction.json").read_text())
  assert result["profile"] == "gpu" and result["complete"] and "cpu" in result["machine"]
  assert set(result["claims"]) == {"1", "2", "4", "5"} and result["digest"] == reporting.record_digest(result)
  assert result["budgets"] == reproduce.design("smollm2", "gpu", True)["budgets"]
  c1 = result["claims"]["1"]
  assert c1["bracket"]["status"] in ("bracketed", "ceiling", "run budget") and c1["tolerance_set_by"]
  assert c1["evidence"]["tolerance_set_by"] == c1["tolerance_set_by"]
  # Claim 2 on 9 held-out prompts, with the paired interval's inputs.
  held = result["claims"]["2"]["heldout"]
  assert held["num_prompts"] == 9 and len(held["recipe_kl_prompts"]) == len(held["edge_kl_prompts"]) == 9
  assert result["claims"]["2"]["evidence"]["heldout_prompts"] == 9
  # Another profile's run into the same --out is refused.
  assert reproduce.main(["--task", "smollm2", "--quick", "--out", str(out)]) == 2
  assert "--profile gpu" in capsys.readouterr().err
