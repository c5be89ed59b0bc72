import numpy as np

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
