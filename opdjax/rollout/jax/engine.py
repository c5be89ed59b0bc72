"""The embedded JAX rollout engine.

One jitted function does the prefill and the whole decode loop over a preallocated KV cache that is
donated into the call and handed back, aliased, for the next one (opdjax.models.kv_cache: one buffer
per layer, written in place). Prompts are left-padded so every row writes the same cache slot at
each step, and each row attends over its own filled slots.

The engine holds its weights as a decode step multiplies them (`install_params`, once per weight
version: opdjax.models.inference.prepare): per layer, q|k|v and gate|up fused, in the compute dtype;
packed fp8 weights from a `weights` view stay fp8 (W8A16: upcast inside the dot, scale after it), or
for an `fp8_matmul` model are multiplied on fp8 with fp8 activations (W8A8).

The loop stays on the device: a `fori_loop` of `max_new_tokens` steps when no EOS can end a row
early; otherwise chunks of `DONE_EVERY` steps, the rows' `done` tested between chunks (a GPU reads a
data-dependent loop condition back to the host at every iteration).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from opdjax.models import inference
from opdjax.models.decoder import Model, positions_from_mask
from opdjax.models.quant import check_fp8_support
from opdjax.parallel.placement import SINGLE
from opdjax.rollout.base import Capabilities, PromptTooLongError, Rollout, RolloutEngine, SamplingParams, pad_prompts
from opdjax.rollout.sampling import sample

DONE_EVERY = 16  # decode steps between two tests of whether every row has ended


def install_params(params, model: Model):
  """The params as the engine holds them (opdjax.models.inference.prepare). Pure, so `jax.eval_shape`
  gives an engine's abstract params."""
  return inference.prepare(params, model.cfg)


def decode_step(prepared, cache, tokens_B, positions_B, start_B, *, model: Model):
  """One new token per row, written at slot `cache["index"]`; row b attends over slots
  `[start_B[b], index]`. Returns `(logits [B, V] fp32, cache)`."""
  h, cache = inference.forward(prepared, cache, tokens_B[:, None], positions_B[:, None], start_B, model.cfg)
  return inference.logits(prepared, h[:, 0], model.cfg), cache


def decode_step_program(model: Model, batch: int, slots: int, placement=None) -> jax.stages.Compiled:
  """The engine's one-token decode step compiled for `batch` rows and a `slots`-slot cache (fp8 when
  the model's config has `kv_quant`), its cache donated: the program a rollout runs per token, for
  reading its HLO (copies, aliasing) from outside."""
  prepared = jax.eval_shape(lambda: install_params(model.init(jax.random.key(0)), model))
  cache = jax.eval_shape(lambda: (placement or SINGLE).kv_cache(model, batch, slots))
  row = jax.ShapeDtypeStruct((batch,), jnp.int32)
  fn = jax.jit(functools.partial(decode_step, model=model), donate_argnums=1)
  return fn.lower(prepared, cache, row, row, row).compile()


def generate_loop(prepared, cache, prompt_BxP, prompt_mask_BxP, rng, *, model: Model,
                  sampling: SamplingParams, eos_ids: tuple[int, ...], pad_id: int):
  b, p = prompt_BxP.shape
  n = sampling.max_new_tokens
  cfg = model.cfg
  positions = positions_from_mask(prompt_mask_BxP)
  start = inference.slot_starts(prompt_mask_BxP)  # left-padded: a row's filled slots are [start, index]
  # The prefill writes slots [0, P) and zeroes the rest in place: the donated cache holds the last
  # call's keys and values, and a diverged call's NaN would poison a masked slot's zero weight.
  h, cache = inference.forward(prepared, {**cache, "index": jnp.zeros((), jnp.int32)}, prompt_BxP, positions, start,
                               cfg, clear_tail=True)
  eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

  def body(_, s):
    rng, sub = jax.random.split(s["rng"])
    tok, lp = sample(s["logits"], sub, sampling)
    live = ~s["done"]
    tok = jnp.where(live, tok, pad_id)
    step = s["step"]
    logits, cache = decode_step(prepared, s["cache"], tok, s["pos"], start, model=model)
    return {"step": step + 1, "done": s["done"] | jnp.isin(tok, eos), "cache": cache, "pos": s["pos"] + 1,
            "rng": rng, "logits": logits,
            "tokens": s["tokens"].at[:, step].set(tok),
            "logprobs": s["logprobs"].at[:, step].set(jnp.where(live, lp, 0.0)),
            "mask": s["mask"].at[:, step].set(live)}

  s = {
      "step": jnp.zeros((), jnp.int32),
      "done": jnp.zeros((b,), bool),
      "tokens": jnp.full((b, n), pad_id, jnp.int32),
      "logprobs": jnp.zeros((b, n), jnp.float32),
      "mask": jnp.zeros((b, n), bool),
      "cache": cache,
      "pos": positions[:, -1] + 1,
      "rng": rng,
      "logits": inference.logits(prepared, h[:, -1], cfg),
  }
  if not eos_ids:
    s = jax.lax.fori_loop(0, n, body, s)
  else:
    chunks, rest = divmod(n, DONE_EVERY)
    chunk = lambda s: jax.lax.fori_loop(0, DONE_EVERY, body, s)
    s = jax.lax.while_loop(lambda s: (s["step"] < chunks * DONE_EVERY) & ~jnp.all(s["done"]), chunk, s)
    if rest:
      s = jax.lax.cond(jnp.all(s["done"]), lambda s: s, lambda s: jax.lax.fori_loop(0, rest, body, s), s)
  return s["tokens"], s["mask"], s["logprobs"], s["cache"]


def _signature(params) -> tuple:
  """What decides the installed weights' shapes and placement: the tree, each leaf's shape, dtype and sharding."""
  leaves, tree = jax.tree.flatten(params)
  return tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


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
    # Compiled once per engine. A new version of the same shapes is installed into the previous one's
    # buffers (donated): a fresh set of weight-sized buffers each step costs page faults on a CPU.
    self._install = jax.jit(functools.partial(install_params, model=model))
    self._reinstall = jax.jit(lambda held, params: install_params(params, model), donate_argnums=0, keep_unused=True)
    self._params, self._signature = None, None
    self.sync(params, version)
    self._cache = None
    self._compiled: dict[SamplingParams, object] = {}

  @property
  def params_version(self) -> int:
    return self._version

  def sync(self, params, version: int) -> None:
    """Installs weights as the engine holds them (`install_params`), once per version."""
    signature = None if params is None else _signature(params)
    if params is None:
      self._params = None
    elif self._params is not None and signature == self._signature:
      self._params = self._reinstall(self._params, params)
    else:
      self._params = self._install(params)
    self._signature = signature
    self._version = version

  def _fn(self, sampling: SamplingParams):
    if sampling not in self._compiled:
      fn = functools.partial(generate_loop, model=self.model, sampling=sampling,
                             eos_ids=self.eos_ids, pad_id=self.pad_id)
      self._compiled[sampling] = jax.jit(fn, donate_argnames=("cache",), **self.placement.generate_jit_kw(self._cache))
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
    if self._cache is None or self._cache["layers"][0]["k"].shape[::2] != (b, total):
      self._cache = self.placement.kv_cache(self.model, b, total, self.kv_dtype)
    rows = self.placement.rows(b)  # a process builds only its own rows (the padding is global)
    toks, mask = self.placement.batch(toks[rows], b), self.placement.batch(mask[rows], b)
    tokens, cmask, lps, self._cache = self._fn(sampling)(self._params, self._cache, toks, mask, jax.random.key(seed))
    return Rollout(prompt_tokens=toks, prompt_mask=mask,
                   completion_tokens=tokens, completion_mask=cmask, rollout_logprobs=lps,
                   params_version=self._version, sampling=sampling, seed=seed)
