"""The embedded JAX rollout engine.

One jitted function does the prefill and the whole decode loop
(`lax.while_loop`, no Python loop per token) over a preallocated KV cache that is
donated into the call and handed back for the next one. Prompts are left-padded
so every row writes the same cache slot at each step; a decode step reads only the
filled part of the cache.

Packed (`QArray`) weights are dequantized inside the jitted function, where XLA fuses
the dequantization into the matmuls; a model with `fp8_matmul` keeps its fp8 layer
weights packed and multiplies them on fp8 with fp8 activations (W8A8).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from opdjax.models.decoder import Model, positions_from_mask
from opdjax.models.quant import QArray, check_fp8_support, fp8_matmul_layout, unpack
from opdjax.parallel.placement import SINGLE
from opdjax.rollout.base import Capabilities, PromptTooLongError, Rollout, RolloutEngine, SamplingParams, pad_prompts
from opdjax.rollout.sampling import sample


def install_params(params, model: Model):
  """The params as the engine holds them: floating leaves cast once to the compute dtype (bf16
  decode reads bf16 weights), and for an `fp8_matmul` model the fp8 layer weights laid out
  `[out, in]` (`fp8_matmul_layout`). Pure, so `jax.eval_shape` gives an engine's abstract params."""
  dt = jnp.dtype(model.cfg.dtype)
  if dt != jnp.float32:
    params = jax.tree.map(
        lambda x: x.astype(dt) if not isinstance(x, QArray) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        params, is_leaf=lambda x: isinstance(x, QArray))
  return fp8_matmul_layout(params) if model.cfg.fp8_matmul else params


def engine_params(params, model: Model):
  """The params the decoder multiplies with: packed weights dequantized, except the fp8 layer
  weights an `fp8_matmul` model multiplies on fp8 (call inside jit)."""
  return unpack(params, keep_fp8=model.cfg.fp8_matmul)


def decode_step(params, cache, tokens_B, positions_B, kv_mask_BxS, *, model: Model):
  """One new token per row: `(logits [B, V] fp32, cache)`. `kv_mask_BxS` already marks the slot
  this token is written to (`cache["index"]`)."""
  params = engine_params(params, model)
  h, cache = model.hidden(params, tokens_B[:, None], positions_B[:, None], kv_mask_BxS, cache)
  return model.logits(params, h[:, 0]), cache


def generate_loop(params, cache, prompt_BxP, prompt_mask_BxP, rng, *, model: Model,
                  sampling: SamplingParams, eos_ids: tuple[int, ...], pad_id: int):
  b, p = prompt_BxP.shape
  n = sampling.max_new_tokens
  positions = positions_from_mask(prompt_mask_BxP)
  kv_mask_BxS = jnp.concatenate([prompt_mask_BxP, jnp.zeros((b, n), bool)], axis=1)
  # The donated cache holds the last call's keys and values: zeroed (in place), as a decode step
  # multiplies its not-yet-written slots by a zero weight and 0 * NaN from a diverged call is NaN.
  cache = {"index": jnp.zeros((), jnp.int32), "k": jnp.zeros_like(cache["k"]), "v": jnp.zeros_like(cache["v"])}
  h, cache = model.hidden(engine_params(params, model), prompt_BxP, positions, kv_mask_BxS, cache)
  logits = model.logits(engine_params(params, model), h[:, -1])
  eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

  def cond(s):
    return (s["step"] < n) & ~jnp.all(s["done"])

  def body(s):
    rng, sub = jax.random.split(s["rng"])
    tok, lp = sample(s["logits"], sub, sampling)
    live = ~s["done"]
    tok = jnp.where(live, tok, pad_id)
    step = s["step"]
    out = {
        "tokens": s["tokens"].at[:, step].set(tok),
        "logprobs": s["logprobs"].at[:, step].set(jnp.where(live, lp, 0.0)),
        "mask": s["mask"].at[:, step].set(live),
    }
    done = s["done"] | jnp.isin(tok, eos)
    kv_mask = s["kv_mask"].at[:, p + step].set(True)
    logits, cache = decode_step(params, s["cache"], tok, s["pos"], kv_mask, model=model)
    return {**out, "step": step + 1, "done": done, "kv_mask": kv_mask, "cache": cache,
            "pos": s["pos"] + 1, "rng": rng, "logits": logits}

  state = {
      "step": jnp.zeros((), jnp.int32),
      "done": jnp.zeros((b,), bool),
      "tokens": jnp.full((b, n), pad_id, jnp.int32),
      "logprobs": jnp.zeros((b, n), jnp.float32),
      "mask": jnp.zeros((b, n), bool),
      "kv_mask": kv_mask_BxS,
      "cache": cache,
      "pos": positions[:, -1] + 1,
      "rng": rng,
      "logits": logits,
  }
  s = jax.lax.while_loop(cond, body, state)
  return s["tokens"], s["mask"], s["logprobs"], s["cache"]


class JaxEngine(RolloutEngine):
  """Batched sampling with the opdjax decoder, fully jitted."""

  capabilities = Capabilities(
      view_parts=frozenset({"compute_dtype", "kv_quant", "act_quant", "weights", "noise_sigma", "lag"}),
      packed_weights=True, processed_logprobs=True)

  def __init__(self, model: Model, params, *, max_len: int, pad_id: int,
               eos_ids: Sequence[int] | None = None, version: int = 0, kv_dtype=None, placement=None):
    """`placement` (opdjax.parallel.placement): rows over the mesh's batch axes and the KV cache
    sharded (weights arrive sharded by the partition rules); None: one device."""
    self.model = model
    self.placement = placement or SINGLE
    self.max_len = max_len
    self.pad_id = pad_id
    self.eos_ids = tuple(model.cfg.eos_ids if eos_ids is None else eos_ids)
    self.kv_dtype = kv_dtype
    if model.cfg.fp8_matmul:
      check_fp8_support(jax.devices()[0])
    self._install = jax.jit(functools.partial(install_params, model=model))  # compiled once per engine
    self.sync(params, version)
    self._cache = None
    self._compiled: dict[SamplingParams, object] = {}

  @property
  def params_version(self) -> int:
    return self._version

  def sync(self, params, version: int) -> None:
    """Installs weights as the engine holds them (`install_params`)."""
    cfg = self.model.cfg
    if params is not None and (jnp.dtype(cfg.dtype) != jnp.float32 or cfg.fp8_matmul):
      params = self._install(params)
    self._params = params
    self._version = version

  def _fn(self, sampling: SamplingParams):
    if sampling not in self._compiled:
      fn = functools.partial(generate_loop, model=self.model, sampling=sampling,
                             eos_ids=self.eos_ids, pad_id=self.pad_id)
      self._compiled[sampling] = jax.jit(fn, donate_argnames=("cache",), **self.placement.generate_jit_kw())
    return self._compiled[sampling]

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int = 0) -> Rollout:
    toks, mask = pad_prompts(prompts, self.pad_id)
    longest = max(len(p) for p in prompts)
    total = toks.shape[1] + sampling.max_new_tokens
    if longest + sampling.max_new_tokens > self.max_len:
      raise PromptTooLongError(
          f"prompt of {longest} tokens + max_new_tokens={sampling.max_new_tokens} exceeds the"
          f" engine's max_len={self.max_len}; shorten the prompt or raise rollout.max_len.")
    b = toks.shape[0]
    if self._cache is None or self._cache["k"].shape[1:3] != (b, total):
      self._cache = self.placement.kv_cache(self.model, b, total, self.kv_dtype)
    rows = self.placement.rows(b)  # a process builds only its own rows (the padding is global)
    toks, mask = self.placement.batch(toks[rows], b), self.placement.batch(mask[rows], b)
    tokens, cmask, lps, self._cache = self._fn(sampling)(self._params, self._cache, toks, mask, jax.random.key(seed))
    return Rollout(prompt_tokens=toks, prompt_mask=mask,
                   completion_tokens=tokens, completion_mask=cmask, rollout_logprobs=lps,
                   params_version=self._version, sampling=sampling, seed=seed)
