"""Every config key and its default: `configs/*.py` start from `default_config()` and change values,
never keys (the dict is locked). `opdjax.config.schema` types and validates the result."""

from __future__ import annotations

import ml_collections


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # task.name "addition" (built-in, exact verifier) or "prompts" (task.path: JSONL of prompts).
  c.task = ml_collections.ConfigDict({"name": "addition", "max_digits": 2, "num_eval": 256, "path": "",
                                      "chat_template": False})
  # Compute dtype of both models' matmuls (params stay fp32; logits and KL are always fp32).
  c.model = ml_collections.ConfigDict({"dtype": "float32", "remat": False})
  # teacher.view: score with a perturbed teacher (e.g. "weights=fp8"); see mismatch.EngineView.
  # path: an HF folder or "fetch:NAME" (opdjax models fetch); keep_layers prunes a loaded model
  # ("0::2" keeps every other layer): a student made from the teacher.
  c.teacher = ml_collections.ConfigDict({
      "path": "", "view": "clean", "keep_layers": "", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
      "sft_steps": 1200, "sft_batch": 64, "sft_lr": 3e-3})
  c.student = ml_collections.ConfigDict({
      "path": "", "keep_layers": "", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "sft_steps": 100,
      "sft_batch": 64, "sft_lr": 3e-3})
  c.rollout = ml_collections.ConfigDict({
      "engine": "jax", "view": "clean", "batch_size": 64,
      # rollout.engine = "vllm": a vLLM server (started here, or `url` to attach) samples; weights
      # are synced every step through reload_weights. quantization / kv_cache_dtype ("fp8") need a GPU.
      "vllm": ml_collections.ConfigDict({
          "url": "", "dtype": "float32", "quantization": "", "kv_cache_dtype": "", "gpu_memory_utilization": 0.0,
          "tensor_parallel_size": 1, "enforce_eager": True, "api_key": "", "python": "", "cpu_kvcache_gib": 1}),
      "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0,
      "top_k": 0, "max_len": 32})
  c.loss = ml_collections.ConfigDict({
      "kind": "full_rkl", "topk": 8, "topk_support": "teacher", "jsd_beta": 0.5,
      "is_correction": "none", "is_threshold": 2.0, "chunk": 64})
  c.optim = ml_collections.ConfigDict({
      "learning_rate": 5e-3, "warmup_steps": 10, "total_steps": 800, "end_lr_fraction": 0.1,
      "weight_decay": 0.0, "b1": 0.9, "b2": 0.95, "max_grad_norm": 1.0})
  # Checkpoints (Orbax) go to OUT/checkpoints every `checkpoint_every` steps and at the end; the
  # same --out resumes from the latest. on_nonfinite: halt (keep the last good checkpoint) or skip.
  c.train = ml_collections.ConfigDict({"steps": 800, "eval_every": 1, "checkpoint_every": 200,
                                       "keep_checkpoints": 3, "best_metric": "reverse_kl",
                                       "on_nonfinite": "halt"})
  # `opdjax mismatch`: engine views (see opdjax.views.view.EngineView), ';'-separated.
  c.mismatch = ml_collections.ConfigDict({
      "sources": ";".join([
          "clean", "compute_dtype=bfloat16", "weights=bf16", "weights=fp8", "weights=fp8_e5m2", "weights=int8",
          "kv_quant=fp8_e4m3", "kv_quant=fp8_e5m2", "noise_sigma=0.01", "noise_sigma=0.03", "noise_sigma=0.1",
          "lag=1", "lag=2", "lag=4", "weights=fp8,kv_quant=fp8_e4m3,lag=2,noise_sigma=0.01"]),
      "warmup_steps": 8, "num_prompts": 128, "seed": 0})
  # `opdjax sensitivity`: quantize/noise one layer and one module kind of `model` at a time;
  # rank by exact KL on the same tokens; build the recipe keeping the fewest most-sensitive layers
  # in bf16 under `target_kl` (0: half of the all-quantized recipe's KL above the clean floor).
  c.sensitivity = ml_collections.ConfigDict({
      "model": "teacher", "formats": "fp8_e4m3,fp8_e5m2,int8", "noise_sigma": 0.05,
      "recipe_format": "fp8_e4m3:channel", "target_kl": 0.0, "num_prompts": 64, "seed": 0})
  # `opdjax prefix-shift`: clean vs perturbed engines on the same prompts and RNG stream.
  c.prefix_shift = ml_collections.ConfigDict({
      "views": ";".join(["noise_sigma=0.01", "noise_sigma=0.03", "noise_sigma=0.1", "noise_sigma=0.3",
                         "weights=fp8", "weights=fp8_e5m2", "lag=1", "lag=4", "lag=16"]),
      "warmup_steps": 16, "num_prompts": 128, "seed": 0})
  # `opdjax calibrate`: short OPD runs at each engine view, `seeds` seeds each; the budget is the
  # largest mismatch whose quality loss vs the clean runs stays within the tolerance.
  c.calibrate = ml_collections.ConfigDict({
      "views": ";".join(["clean", "noise_sigma=0.1", "noise_sigma=0.4", "noise_sigma=0.8", "noise_sigma=1.6",
                         "noise_sigma=3.2", "lag=4", "lag=32"]),
      "seeds": 3, "steps": 800, "eval_every": 100, "tolerance_sigmas": 2.0, "tolerance_rel": 0.05,
      "warmup_steps": 32, "num_prompts": 128, "seed": 0})
  # `opdjax admit`: candidates' mismatch on the calibration batch, bootstrap interval over
  # sequences; KV-cache capacity benefit computed for `memory_gib` of device memory.
  c.admit = ml_collections.ConfigDict({"bootstrap": 1000, "confidence": 0.95, "memory_gib": 72.0})
  # GRPO baseline (scripts/compare_opd_grpo.py): rollout.batch_size completions per step, in groups
  # of group_size per prompt; learning_rate 0 uses optim.learning_rate.
  c.grpo = ml_collections.ConfigDict({"group_size": 8, "normalize_std": True, "is_correction": "none",
                                      "is_threshold": 2.0, "learning_rate": 0.0})
  c.lock()  # configs may change these keys, never add new ones
  return c
