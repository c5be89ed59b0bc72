"""The offline demo: a cached addition teacher, a smaller weaker student, OPD.

Both models are built here on first use by supervised training on the task and
cached as Hugging Face safetensors folders under the user's cache dir, so later
runs start in seconds and the folders load in transformers too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from opdjax.models import Model, ModelConfig, load_hf_params, save_hf_params
from opdjax.models.decoder import positions_from_mask
from opdjax.scoring import masked_mean
from opdjax.tasks.addition import BOS, EOS, PAD, VOCAB_SIZE, AdditionTask

_CACHE_FORMAT = 1


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
  # `opdjax mismatch`: engine views (see opdjax.mismatch.EngineView), ';'-separated.
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


def demo_model_config(hidden: int, layers: int, heads: int) -> ModelConfig:
  return ModelConfig(
      model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 4,
      num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
      max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def cache_root() -> str:
  base = os.environ.get("OPDJAX_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "opdjax")
  return base


def sft_batch(task: AdditionTask, pairs: np.ndarray):
  """Teacher-forced sequences `prompt + answer`, loss on the answer tokens only."""
  seqs = [(task.prompt(a, b), task.answer(a, b)) for a, b in pairs]
  length = max(len(p) + len(a) for p, a in seqs)
  toks = np.full((len(seqs), length), PAD, np.int32)
  loss_mask = np.zeros((len(seqs), length), np.float32)
  for i, (p, a) in enumerate(seqs):
    toks[i, : len(p) + len(a)] = p + a
    loss_mask[i, len(p) - 1 : len(p) + len(a) - 1] = 1.0
  mask = toks != PAD
  return {"tokens": toks[:, :-1], "mask": mask[:, :-1], "targets": toks[:, 1:], "loss_mask": loss_mask[:, :-1]}


def _sft_loss(params, batch, model: Model):
  pos = positions_from_mask(batch["mask"])
  logits, _ = model.apply(params, batch["tokens"], pos, batch["mask"])
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  return masked_mean(nll, batch["loss_mask"])


def sft(model: Model, task: AdditionTask, steps: int, batch_size: int, lr: float, seed: int,
        progress: str | None = None):
  """Supervised training on the task (used only to build the demo's models)."""
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, 50, max(steps, 51), lr * 0.05))
  params = model.init(jax.random.key(seed))
  opt_state = opt.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    loss, g = jax.value_and_grad(_sft_loss)(params, batch, model)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  rng = np.random.default_rng(seed + 1)
  it = range(steps)
  if progress:
    from tqdm import tqdm
    it = tqdm(it, desc=progress, unit="step", leave=False)
  for _ in it:
    params, opt_state, _ = step(params, opt_state, sft_batch(task, task.sample_pairs(rng, batch_size)))
  return params


def cached_sft_model(role: str, mc: ml_collections.ConfigDict, task: AdditionTask, seed: int):
  """Loads the demo model for `role` from the cache, training and caching it first if absent."""
  cfg = demo_model_config(mc.hidden_size, mc.num_layers, mc.num_heads)
  key = json.dumps({"v": _CACHE_FORMAT, "cfg": cfg.to_hf_dict(), "digits": task.max_digits,
                    "steps": mc.sft_steps, "batch": mc.sft_batch, "lr": mc.sft_lr, "seed": seed},
                   sort_keys=True)
  path = os.path.join(cache_root(), "demo", f"{role}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
  if not os.path.exists(os.path.join(path, "config.json")):
    params = sft(Model(cfg), task, mc.sft_steps, mc.sft_batch, mc.sft_lr, seed,
                 progress=f"building demo {role} (cached for later runs)")
    try:
      save_hf_params(params, cfg, path)
    except FileExistsError:  # another process finished first; use its copy
      pass
  return Model(cfg), load_hf_params(path, cfg), path
