"""The paper's study on a real LM: SmolLM2-135M-Instruct teacher, a 20-layer student of it.

  python scripts/reproduce.py --task smollm2 --out runs/repro-smollm2     # the whole study
  opdjax train --config configs/smollm2_study.py --out runs/smollm2-study  # one OPD run of it

Prompts: the 640 template instructions of opdjax/data/chat_instructions.jsonl (the last 128 held
out), through the model's chat template; responses of up to 32 sampled tokens ending at <|im_end|>
(EOS). Quality is the held-out reverse KL to the teacher on the student's own samples (no
verifier). The student is the teacher with its layers 10-19 dropped (20 of 30 kept). Sized for a
2-core CPU box: a batch of 4 prompts, 10 steps at peak lr 1.5e-5 with cosine decay. The learn check
(docs/reproduction.md, idle box): held-out reverse KL (128 prompts) 4.20 -> 2.20 (-48%) and 4.12 ->
2.26 (-45%) on seeds 0 and 1, entropy 3-4 nats throughout, 3.4 min a run. (The every-other-layer
student of configs/smollm2_opd.py starts at 6.41 and did not: -17% / +2%, its entropy collapsing.)
The analysis sections are what scripts/reproduce.py runs; its sweeps evaluate on the first 32
held-out prompts (builtin:chat_instructions_sweep: evaluation is most of a short run's cost).
"""

from opdjax.config.defaults import default_config


def get_config():
  c = default_config()
  c.task.name = "prompts"
  c.task.path = "builtin:chat_instructions"
  c.task.chat_template = True
  c.task.num_eval = 128
  c.teacher.path = "fetch:smollm2-135m"
  c.student.path = "fetch:smollm2-135m"
  c.student.keep_layers = ",".join(map(str, [*range(10), *range(20, 30)]))  # layers 10-19 dropped
  c.rollout.batch_size = 4
  c.rollout.max_new_tokens = 32
  c.rollout.max_len = 88  # prompts are 36-50 tokens with the template
  c.loss.kind = "full_rkl"
  c.loss.chunk = 8  # positions per [B, chunk, V] logits block: 49k vocab; 32 ran the 24 GiB box out of memory
  c.optim.learning_rate = 1.5e-5
  c.optim.warmup_steps = 2
  c.optim.total_steps = 10
  c.train.steps = 10
  c.train.eval_every = 10
  c.train.checkpoint_every = 1000
  # Calibration: a noise ladder plus FP8/INT8 weights, 2 seeds of the 10-step run each.
  c.calibrate.views = ";".join(["clean", "noise_sigma=0.02", "noise_sigma=0.05", "noise_sigma=0.15", "weights=fp8",
                                "weights=int8"])
  c.calibrate.seeds = 2
  c.calibrate.steps = 10
  c.calibrate.eval_every = 10
  c.calibrate.warmup_steps = 4
  c.calibrate.num_prompts = 32
  c.admit.bootstrap = 500
  c.prefix_shift.views = ";".join(["noise_sigma=0.02", "noise_sigma=0.15", "weights=fp8", "lag=1", "lag=4"])
  c.prefix_shift.warmup_steps = 4
  c.prefix_shift.num_prompts = 32
  c.sensitivity.model = "teacher"
  c.sensitivity.formats = "fp8_e4m3"
  c.sensitivity.noise_sigma = 0.0
  c.sensitivity.num_prompts = 8
  return c
