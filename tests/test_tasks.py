import numpy as np
import pytest

from opdjax.tasks.addition import EOS, AdditionTask


def test_verifier_accepts_only_the_reversed_sum():
  task = AdditionTask(3)
  assert task.is_correct((57, 68), task.tokenizer.encode("521") + [EOS])
  assert not task.is_correct((57, 68), task.tokenizer.encode("125") + [EOS])
  assert not task.is_correct((57, 68), task.tokenizer.encode("521"))  # no EOS
  assert task.tokenizer.decode(task.prompt(12, 3)) == "12+3="


def test_pairs_cover_digit_counts_and_eval_set_is_fixed():
  task = AdditionTask(3)
  pairs = task.sample_pairs(np.random.default_rng(0), 3000)
  assert pairs.max() < 1000 and pairs.min() >= 0
  assert (pairs < 10).mean() > 0.2  # one-digit numbers are not vanishingly rare
  np.testing.assert_array_equal(task.eval_pairs(64), task.eval_pairs(64))
  assert all(len(p) <= task.max_prompt_tokens for p in task.prompts(pairs))


def test_worked_answers_write_every_column_then_the_sum():
  task = AdditionTask(max_digits=2, answer_format="worked")
  tok = task.tokenizer
  assert tok.decode(task.answer(47, 85)) == "75024813=231" and task.answer(47, 85)[-1] == EOS
  assert tok.decode(task.answer(5, 0)) == "5005=5"
  assert tok.decode(task.answer(99, 9)) == "99089010=801"  # 9+9=18: 8, carry 1; 9+0+1=10: 0, carry 1
  longest = max(len(task.answer(a, b)) for a in range(100) for b in range(100))
  assert longest == task.max_answer_tokens == 13
  assert task.is_correct((47, 85), task.answer(47, 85))
  assert not task.is_correct((47, 85), tok.encode("231") + [EOS])  # the bare sum is not the worked answer
  with pytest.raises(ValueError, match="answer_format"):
    AdditionTask(answer_format="long")


def test_worked_answers_need_room_in_the_rollout():
  from opdjax.config.resolve import resolve_config
  from opdjax.errors import UserError
  from opdjax.pipeline.build import make_task

  cfg = resolve_config("configs/demo_worked.py", {})
  assert make_task(cfg).answer_format == "worked"
  with pytest.raises(UserError, match="rollout.max_new_tokens >= 13"):
    make_task(resolve_config("configs/demo_worked.py", {"rollout.max_new_tokens": "6"}))


def _conforms(task) -> None:
  """`task` has every member of the written interface (opdjax.tasks.interface.Task), each method taking as many
  parameters as the interface's, and behaves as the interface says on a small draw."""
  import inspect

  from opdjax.errors import UserError
  from opdjax.tasks.interface import Task

  assert isinstance(task, Task), type(task)
  for name, member in vars(Task).items():
    if callable(member) and not name.startswith("_"):
      want = len(inspect.signature(member).parameters) - 1  # (self)
      assert len(inspect.signature(getattr(task, name)).parameters) == want, (type(task).__name__, name)
  assert isinstance(task.pad_id, int) and isinstance(task.vocab_size, int) and isinstance(task.has_verifier, bool)
  assert isinstance(task.eos_ids, tuple) and all(isinstance(i, int) for i in task.eos_ids)
  prompts, refs = task.train_batch(np.random.default_rng(0), 3)
  held, held_refs = task.eval_set()
  assert len(prompts) == len(refs) == 3 and held and max(max(p) for p in prompts + held) < task.vocab_size
  assert isinstance(task.tokenizer.decode(prompts[0]), str)
  assert len(task.tags(refs)) == 3 and len(task.tags(None)) == len(held)
  score = task.score(refs, prompts)
  if task.has_verifier:
    assert isinstance(score, float) and isinstance(task.is_correct(refs[0], prompts[0]), bool)
  else:
    assert score is None
    with pytest.raises(UserError, match="no verifier"):
      task.is_correct(refs[0], prompts[0])
  with pytest.raises(UserError, match="teacher.routes"):
    task.check_tags(["no-such-tag"])


@pytest.mark.slow
def test_every_task_conforms_to_the_written_interface_and_make_task_looks_it_up(tmp_path):
  """Every task class of opdjax.tasks, built by `make_task` from the config as a run builds it, conforms; the
  lookup names exactly the config's task.name choices."""
  import importlib
  import json
  import pkgutil

  import tiny_hub

  import opdjax.tasks
  from opdjax.config.loader import ConfigError
  from opdjax.config.resolve import resolve_config
  from opdjax.config.sections import TASKS as NAMES
  from opdjax.pipeline.build import TASKS, make_task

  assert set(TASKS) == set(NAMES)
  tiny_hub.tokenizer(tmp_path / "tok")
  with open(tmp_path / "p.jsonl", "w") as f:
    for i, text in enumerate(tiny_hub.prompts(12)):
      f.write(json.dumps({"prompt": text, "tag": "ab"[i % 2]}) + "\n")
  prompts = {"task.name": "prompts", "teacher.path": str(tmp_path / "tok"), "student.path": str(tmp_path / "tok"),
             "task.num_eval": "4", "rollout.max_len": "48", "rollout.max_new_tokens": "8"}
  configs = [{}, {"task.answer": "worked", "rollout.max_new_tokens": "18", "rollout.max_len": "32"},
             {**prompts, "task.path": str(tmp_path / "p.jsonl")}]
  try:
    import datasets

    datasets.Dataset.from_dict({"q": tiny_hub.prompts(12)}).to_parquet(str(tmp_path / "p.parquet"))
    configs.append({**prompts, "task.dataset": str(tmp_path / "p.parquet"), "task.prompt_field": "q"})
  except ImportError:  # (the data extra absent: DatasetTask is left out below)
    pass
  built = [make_task(resolve_config("configs/demo.py", c)) for c in configs]
  for task in built:
    _conforms(task)
  classes = {obj for info in pkgutil.iter_modules(opdjax.tasks.__path__)
             for obj in vars(importlib.import_module(f"opdjax.tasks.{info.name}")).values()
             if isinstance(obj, type) and obj.__module__.startswith("opdjax.tasks.") and hasattr(obj, "train_batch")
             and obj.__name__ != "Task"}
  skipped = set() if len(configs) == 4 else {c for c in classes if c.__name__ == "DatasetTask"}
  assert classes - skipped == {type(t) for t in built}, classes  # every task class is built and checked
  with pytest.raises(ConfigError, match="task.name"):
    resolve_config("configs/demo.py", {"task.name": "chess"})
