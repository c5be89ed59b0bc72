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
