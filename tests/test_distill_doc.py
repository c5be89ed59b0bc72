"""The README's "Distill your own pair" command runs as written: its Hub ids are tiny models in a local Hugging Face
cache (offline), its dataset a local parquet of chat prompts, and a handful of steps are appended."""

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


def doc_command() -> list[str]:
  """The one `opdjax train` command of the README section's bash blocks, as argv."""
  section = open(DOC).read().split("## Distill your own pair", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
  commands = [shlex.split(b.replace("\\\n", " ")) for b in blocks if "opdjax train" in b]
  assert len(commands) == 1, commands
  return commands[0]


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
  assert cli.main(argv[1:] + SMALL) == 0
  out = tmp_path / argv[argv.index("--out") + 1]
  recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in recs] == [0, 1, 2, 3] and all("truncated_frac" in r for r in recs[1:])
  assert len(open(out / "samples.jsonl").readlines()) == 3 * 4  # a few samples at each of the steps
  assert os.path.isdir(out / "tensorboard")  # train.loggers as the page sets it
  assert os.path.exists(out / "student" / "model.safetensors")
