"""Layer sensitivity of SmolLM2-135M-Instruct (the teacher of configs/smollm2_opd.py).

  opdjax sensitivity --config configs/smollm2_sensitivity.py --out runs/smollm2-sensitivity

8 held-out chat prompts x 32 sampled tokens (~250 tokens, every sweep point a full forward of the
135M model): 30 layers x 4 perturbations plus 10 module kinds, then the recipe search; about 190
forwards, a few minutes on 2 idle CPU cores. See docs/sensitivity.md.
"""

import os

from opdjax.config.loader import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_opd.py"))
  c.task.num_eval = 16  # the last 16 of the 64 shipped prompts are held out
  c.sensitivity.model = "teacher"
  c.sensitivity.num_prompts = 8
  return c
