"""Prompts from `datasets` (task.dataset): a local parquet file and a save_to_disk folder, text and chat columns."""

import numpy as np
import pytest
import tiny_hub

from opdjax.config.defaults import default_config
from opdjax.config.loader import apply_overrides
from opdjax.config.schema import build
from opdjax.errors import UserError
from opdjax.pipeline.build import make_task
from opdjax.tasks.dataset import shard_span

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  tiny_hub.tokenizer(root / "chat")
  tiny_hub.tokenizer(root / "plain", chat_template=False)
  return root


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds-cache"))


def _cfg(tok, name="chat", seed=0, **task):
  overrides = {"seed": str(seed), "task.name": "prompts", "teacher.path": str(tok / name),
               "student.path": str(tok / name), "task.num_eval": "4", "rollout.max_len": "48",
               "rollout.max_new_tokens": "8"}
  overrides.update({f"task.{k}": str(v) for k, v in task.items()})
  return build(apply_overrides(default_config(), overrides))


def _texts(n, seed=0):
  return tiny_hub.prompts(n, seed)


def test_prompts_from_a_local_parquet_with_a_deterministic_held_out_fraction(tok, tmp_path):
  from transformers import AutoTokenizer

  texts = _texts(20)
  path = tmp_path / "prompts.parquet"
  datasets.Dataset.from_dict({"question": texts, "kind": ["a", "b"] * 10}).to_parquet(str(path))
  task = make_task(_cfg(tok, "plain", dataset=path, prompt_field="question", tag_field="kind"))
  t = AutoTokenizer.from_pretrained(tok / "plain")
  encoded = [t(x)["input_ids"] for x in texts]
  train, (held, _) = task._train, task.eval_set()
  assert len(train) == 16 and len(held) == 4
  assert sorted(map(tuple, train + held)) == sorted(map(tuple, encoded))  # every row once, in one of the two
  again = make_task(_cfg(tok, "plain", dataset=path, prompt_field="question", tag_field="kind", seed=7))
  assert again.eval_set()[0] == held  # the held-back rows depend on the dataset alone, not the run's seed
  assert held != encoded[-4:]  # held back by a permutation, not the file's tail
  prompts, refs = task.train_batch(np.random.default_rng(0), 6)
  tags = task.tags(refs)
  assert set(tags) <= {"a", "b"} and all(encoded.index(p) % 2 == "ab".index(g) for p, g in zip(prompts, tags))


def test_chat_messages_from_a_save_to_disk_folder_with_an_eval_split(tok, tmp_path):
  from transformers import AutoTokenizer

  train_texts, test_texts = _texts(12, 1), _texts(6, 2)
  msgs = lambda xs: [[{"role": "system", "content": "wa"}, {"role": "user", "content": x},
                      {"role": "assistant", "content": "wb wc"}] for x in xs]  # the reply is dropped
  folder = tmp_path / "saved"
  datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": msgs(train_texts)}),
                        "test": datasets.Dataset.from_dict({"messages": msgs(test_texts)})}).save_to_disk(str(folder))
  task = make_task(_cfg(tok, dataset=folder, messages_field="messages", eval_split="test"))
  t = AutoTokenizer.from_pretrained(tok / "chat")
  want = t(f"system: wa\nuser: {test_texts[0]}\nassistant:", add_special_tokens=False)["input_ids"]
  assert task.eval_set()[0][0] == want  # rendered through the chat template, generation prompt included
  assert len(task._train) == 12 and len(task.eval_set()[0]) == 4  # num_eval rows of the eval split
  assert task.tokenizer.decode(want).endswith("assistant:")


@pytest.mark.parametrize("task, match", [
    ({"prompt_field": "text"}, r"task.prompt_field='text' is not a column of .* its columns are 'question'"),
    ({"prompt_field": "question", "split": "validation"}, r"the file .* is one split \(train\)"),
])
def test_bad_dataset_input_is_one_line(tok, tmp_path, task, match):
  path = tmp_path / "p.parquet"
  datasets.Dataset.from_dict({"question": _texts(10)}).to_parquet(str(path))
  with pytest.raises(UserError, match=match) as e:
    make_task(_cfg(tok, "plain", dataset=path, **task))
  assert "\n" not in str(e.value)


def test_an_empty_field_and_a_chat_column_without_a_template_are_one_line_each(tok, tmp_path):
  path = tmp_path / "p.parquet"
  datasets.Dataset.from_dict({"question": _texts(8)[:5] + ["  "] + _texts(2)}).to_parquet(str(path))
  with pytest.raises(UserError, match=r"row 5: task.prompt_field='question' is empty"):
    make_task(_cfg(tok, "plain", dataset=path, prompt_field="question", num_eval=2))
  chat = tmp_path / "c.parquet"
  datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "wa"}]] * 8}).to_parquet(str(chat))
  with pytest.raises(UserError, match="renders prompts with the student's chat template, but the tokenizer"):
    make_task(_cfg(tok, "plain", dataset=chat, messages_field="messages", num_eval=2))
  with pytest.raises(UserError, match="set task.name='prompts'"):
    build(apply_overrides(default_config(), {"task.dataset": str(path)}))


def test_each_process_reads_a_contiguous_slice():
  spans = [shard_span(10, i, 3) for i in range(3)]
  assert spans == [(0, 4), (4, 7), (7, 10)]
  assert shard_span(2, 2, 3) == (2, 2)  # more processes than rows: an empty slice


SLICE = """
import json, sys
from opdjax.pipeline import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), 60)
from opdjax.config.defaults import default_config
from opdjax.config.loader import apply_overrides
from opdjax.config.schema import build
from opdjax.pipeline.build import make_task
from opdjax.tasks.dataset import DatasetTask
seen = []
encode = DatasetTask._encode_value
DatasetTask._encode_value = lambda self, v, where: (seen.append(where), encode(self, v, where))[1]
cfg = build(apply_overrides(default_config(), json.loads(sys.argv[3])))
task = make_task(cfg)
print(json.dumps({"train": task._train, "eval": task.eval_set()[0], "tags": task.tags(None), "seen": seen}))
distributed.finish()
"""


@pytest.mark.slow
def test_two_processes_each_tokenize_their_slice_and_hold_the_same_prompts(tok, tmp_path):
  """Two jax.distributed processes: each tokenizes about half the rows, and both end with the prompts a
  single process reads (same order, same held-out rows, same tags)."""
  import json
  import os
  import subprocess
  import sys

  from helpers import free_port

  path = tmp_path / "p.parquet"
  datasets.Dataset.from_dict({"question": _texts(21), "kind": ["a", "b", "c"] * 7}).to_parquet(str(path))
  task_keys = {"dataset": path, "prompt_field": "question", "tag_field": "kind"}
  single = make_task(_cfg(tok, "plain", **task_keys))
  overrides = {"task.name": "prompts", "teacher.path": str(tok / "plain"), "student.path": str(tok / "plain"),
               "task.num_eval": "4", "rollout.max_len": "48", "rollout.max_new_tokens": "8",
               **{f"task.{k}": str(v) for k, v in task_keys.items()}}
  port = free_port()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, "-c", SLICE, f"127.0.0.1:{port}", str(i), json.dumps(overrides)],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=240) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  got = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
  for g in got:
    assert g["train"] == single._train and g["eval"] == single.eval_set()[0] and g["tags"] == single.tags(None)
  seen = [set(g["seen"]) for g in got]
  assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 21  # each row tokenized once, by one process
  assert all(8 <= len(s) <= 13 for s in seen)  # about half each


def test_long_prompts_are_refused_by_default_and_dropped_when_asked(tok, tmp_path, capsys):
  """A prompt over rollout.max_len - max_new_tokens: refused naming the longest and the option, or dropped with a
  count line (and the longest length) under task.long_prompts=drop, the rest kept."""
  path = tmp_path / "p.parquet"
  texts = _texts(20)
  texts[3] = " ".join(["wa wb wc wd we"] * 40)  # far over the 40 prompt tokens left
  datasets.Dataset.from_dict({"question": texts}).to_parquet(str(path))
  keys = {"dataset": path, "prompt_field": "question"}
  with pytest.raises(UserError) as e:
    make_task(_cfg(tok, "plain", **keys))
  msg = str(e.value)
  assert "1 prompts exceed 40 tokens" in msg and "row 3" in msg and "task.long_prompts=drop" in msg, msg
  task = make_task(_cfg(tok, "plain", long_prompts="drop", **keys))
  err = capsys.readouterr().err
  assert "dropped 1 prompts over 40 tokens" in err and "row 3" in err, err
  assert len(task._train) + len(task.eval_set()[0]) == 19 and all(len(p) <= 40 for p in task._train)
  with pytest.raises(UserError, match="task.long_prompts"):
    _cfg(tok, "plain", long_prompts="cut", **keys)
