"""The demo with worked answers (task.answer='worked'): the same 2-digit additions, each answer its
column sums then the reversed sum (up to 13 tokens instead of 4), so sampling is a larger share of a
step, as in OPD of reasoning models whose responses are thousands of tokens. Teacher and student are
built for it (their own cache entries). The task variant of scripts/time_to_quality.py:

  python scripts/time_to_quality.py --config configs/demo_worked.py --out runs/ttq_worked
"""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.task.answer = "worked"
  c.rollout.max_new_tokens = 13  # 5 * task.max_digits + 3
  # The student's supervised start: 100 steps (the sum's) leave it at 0.8% held-out accuracy on worked
  # answers and OPD at 8% after 400 steps; 200 start it at 25%, and OPD reaches 95% in ~450 of 800 steps
  # (the sum's demo: 1.6% -> 98%). (300: 43%; 600: 98%, nothing left to distil.)
  c.student.sft_steps = 200
  return c
