"""The offline demo: a cached addition teacher, a smaller weaker student, OPD.

Both models are built here on first use by supervised training on the task and
cached as Hugging Face safetensors folders under the user's cache dir, so later
runs start in seconds and the folders load in transformers too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from opdjax.models import Model, ModelConfig, load_hf_params, save_hf_params
from opdjax.models.decoder import positions_from_mask
from opdjax.models.fetch import cache_root
from opdjax.scoring.rescore import masked_mean
from opdjax.tasks.addition import BOS, EOS, PAD, VOCAB_SIZE, AdditionTask

_CACHE_FORMAT = 1


def demo_model_config(hidden: int, layers: int, heads: int) -> ModelConfig:
  return ModelConfig(
      model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 4,
      num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
      max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)



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
  if progress and sys.stderr.isatty():
    from tqdm import tqdm
    it = tqdm(it, desc=progress, unit="step", leave=False)
  elif progress:  # a log: one line, not a bar's frames
    print(f"{progress}: {steps} supervised steps", file=sys.stderr, flush=True)
  for _ in it:
    params, opt_state, _ = step(params, opt_state, sft_batch(task, task.sample_pairs(rng, batch_size)))
  return params


def cached_sft_model(role: str, mc: ml_collections.ConfigDict, task: AdditionTask, seed: int):
  """Loads the demo model for `role` from the cache, training and caching it first if absent."""
  cfg = demo_model_config(mc.hidden_size, mc.num_layers, mc.num_heads)
  key = {"v": _CACHE_FORMAT, "cfg": cfg.to_hf_dict(), "digits": task.max_digits,
         "steps": mc.sft_steps, "batch": mc.sft_batch, "lr": mc.sft_lr, "seed": seed}
  if task.answer_format != "sum":  # (the sum's cache keys stay those of every cache already built)
    key["answer"] = task.answer_format
  key = json.dumps(key, sort_keys=True)
  path = os.path.join(cache_root(), "demo", f"{role}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
  if not os.path.exists(os.path.join(path, "config.json")):
    with _one_builder(path):
      if not os.path.exists(os.path.join(path, "config.json")):  # or the process we waited for built it
        params = sft(Model(cfg), task, mc.sft_steps, mc.sft_batch, mc.sft_lr, seed,
                     progress=f"building demo {role} (cached for later runs)")
        save_hf_params(params, cfg, path)
  return Model(cfg), load_hf_params(path, cfg), path


@contextlib.contextmanager
def _one_builder(path: str):
  """An exclusive lock on PATH.lock: processes that find a demo model missing at once (the processes of
  a multi-process run, jobs started together on a fresh cache, test workers) build it once. The others
  wait, then load the first one's copy. The kernel drops the lock of a process that dies."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".lock", "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    yield
