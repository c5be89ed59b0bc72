"""Rollout/trainer mismatch on one scale.

Per completion token, r = log p_trainer(y) - log q_rollout(y): the same token, scored by the
trainer with its current params and by the engine that sampled it. With the mask m:

- `kl_k1`  = mean(-r): unbiased estimate of KL(rollout || trainer) (can be negative on a batch).
- `kl_k3`  = mean(e^r - r - 1): unbiased, always >= 0, lower variance (Schulman's k3).
  Both token-averaged (`*_tok`, every token weighs the same) and sequence-averaged (`*_seq`,
  mean over sequences of each sequence's token mean).
- `abs_r_mean`, `abs_r_max`: mean and max |r|.
- `prob_err_mult` = mean(e^|r|): the typical multiplicative error of a token's probability.
- `chi2_tok` = mean(e^(2r)) - 1 with r clamped to [-C, C]: chi-square divergence estimate, the
  variance of per-token importance weights; `chi2_seq`: the same for the sequence weights
  e^(sum_t r_t) (sums clamped).
- `ess_tok`, `ess_seq`: effective sample size fractions (sum w)^2 / (n sum w^2) of the importance
  weights w = e^r (1 = no mismatch).
- `prob_corr`: Pearson correlation of the two sides' token probabilities e^logp.
- `exact_kl`: the full-vocabulary KL(rollout || trainer) per position, averaged over tokens, when
  the rollout engine's distribution can be re-computed (the embedded engine's view: same weights
  perturbation, compute dtype and KV rounding). The k3 estimate converges to it (tested).
All token reductions are masked; every formula is in docs/mismatch.md too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from opdjax import perturb
from opdjax.errors import UserError
from opdjax.models.decoder import Model
from opdjax.rollout.base import SamplingParams
from opdjax.rollout.sampling import sampling_logprobs
from opdjax.scoring import TrainBatch, chunked_over_positions, masked_mean


def _seq_mean(x, mask):
  per_seq = jnp.sum(x * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
  has = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
  return jnp.sum(per_seq * has) / jnp.maximum(jnp.sum(has), 1.0)


def _ess(logw, valid):
  """(sum w)^2 / (n sum w^2), computed from log-weights, over `valid` entries."""
  logw = jnp.where(valid, logw, -jnp.inf)
  n = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
  return jnp.exp(2 * jax.nn.logsumexp(logw) - jax.nn.logsumexp(2 * logw)) / n


def sampled_metrics(rollout_logprobs, trainer_logprobs, mask, clamp: float = 20.0) -> dict[str, jax.Array]:
  """Mismatch metrics from the sampled tokens' log-probs on both sides (all `[B, N]`)."""
  mask = mask.astype(jnp.float32)
  valid = mask > 0
  r = jnp.where(valid, trainer_logprobs - rollout_logprobs, 0.0)
  rc = jnp.clip(r, -clamp, clamp)
  k1, k3 = -r, jnp.expm1(r) - r
  seq_r = jnp.clip(jnp.sum(r * mask, axis=-1), -clamp, clamp)
  has = jnp.sum(mask, axis=-1) > 0
  seq_w2 = jnp.where(has, jnp.exp(2 * seq_r), 0.0)
  p_roll, p_train = jnp.exp(rollout_logprobs), jnp.exp(trainer_logprobs)
  mu_a, mu_b = masked_mean(p_roll, mask), masked_mean(p_train, mask)
  cov = masked_mean((p_roll - mu_a) * (p_train - mu_b), mask)
  var_a, var_b = masked_mean(jnp.square(p_roll - mu_a), mask), masked_mean(jnp.square(p_train - mu_b), mask)
  return {
      "kl_k1_tok": masked_mean(k1, mask),
      "kl_k1_seq": _seq_mean(k1, mask),
      "kl_k3_tok": masked_mean(k3, mask),
      "kl_k3_seq": _seq_mean(k3, mask),
      "abs_r_mean": masked_mean(jnp.abs(r), mask),
      "abs_r_max": jnp.max(jnp.where(valid, jnp.abs(r), 0.0)),
      "prob_err_mult": masked_mean(jnp.exp(jnp.abs(rc)), mask),
      "chi2_tok": masked_mean(jnp.exp(2 * rc), mask) - 1.0,
      "chi2_seq": jnp.sum(seq_w2) / jnp.maximum(jnp.sum(has), 1) - 1.0,
      "ess_tok": _ess(rc, valid),
      "ess_seq": _ess(seq_r, has),
      "prob_corr": cov / jnp.sqrt(jnp.maximum(var_a * var_b, 1e-30)),
  }


def exact_kl(view: Model, view_params, trainer: Model, trainer_params, batch: TrainBatch,
             sampling: SamplingParams | None = None, chunk: int = 128) -> jax.Array:
  """Full-vocabulary KL(engine view || trainer) at every position `[B, L]` (0 off the mask).

  The engine side is the distribution it samples from (temperature, top-k, top-p applied); the
  trainer side is the trainer's model at the same temperature, the same as `token_logprobs`.
  """
  sampling = sampling or SamplingParams()
  args = (batch["tokens"], batch["positions"], batch["attention_mask"])
  h_v, _ = view.hidden(view_params, *args)
  h_t, _ = trainer.hidden(trainer_params, *args)
  temp = sampling.temperature if sampling.temperature > 0 else 1.0

  def per_chunk(hv, ht):
    shape = hv.shape[:-1]
    logq = sampling_logprobs(view.logits(view_params, hv).reshape(-1, view.cfg.vocab_size), sampling)
    logp = jax.nn.log_softmax(trainer.logits(trainer_params, ht).reshape(logq.shape) / temp, axis=-1)
    q = jnp.exp(logq)
    kl = jnp.sum(jnp.where(q > 0, q * (logq - logp), 0.0), axis=-1)
    return kl.reshape(shape)

  return chunked_over_positions(per_chunk, chunk, h_v, h_t) * batch["loss_mask"]


# --- the engine's view of the weights ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EngineView:
  """How the rollout engine differs from the trainer (the default is no difference).

  Applied in this order: params `lag` optimizer steps old -> Gaussian `noise_sigma` (relative
  to each matrix's RMS) -> weight quantization `weights` -> compute in `compute_dtype`, with the
  KV cache rounded through `kv_quant` and projection inputs through `act_quant` (W8A8).
  `weights` is `fp32`, a preset name (`perturb.preset`: fp8, fp8_block, fp8_e5m2, int8, bf16) or
  an explicit recipe `pattern>format|pattern>format`.
  """

  compute_dtype: str = "float32"
  weights: str = "fp32"
  keep_edge_layers: int = 0
  kv_quant: str = "none"
  kv_scale: str = "per_head"
  act_quant: str = "none"
  noise_sigma: float = 0.0
  noise_seed: int = 0
  lag: int = 0

  @classmethod
  def parse(cls, spec: str) -> EngineView:
    """`"weights=fp8,kv_quant=fp8_e4m3,lag=2"`; empty or `clean` is the unperturbed view."""
    spec = spec.strip()
    if spec in ("", "clean"):
      return cls()
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    kw = {}
    for item in spec.split(","):
      key, eq, value = item.strip().partition("=")
      if not eq or key not in fields:
        raise UserError(f"bad engine-view item {item!r} in {spec!r}; use key=value with keys {', '.join(fields)}.")
      default = getattr(cls(), key)
      try:
        kw[key] = type(default)(value)
      except ValueError:
        raise UserError(f"engine view {key}={value!r}: expected {type(default).__name__}.") from None
    view = cls(**kw)
    view.check()
    return view

  def check(self):
    if self.compute_dtype not in ("float32", "bfloat16"):
      raise UserError(f"compute_dtype={self.compute_dtype!r}; choose float32 or bfloat16.")
    if self.noise_sigma < 0 or self.lag < 0:
      raise UserError("noise_sigma and lag must be >= 0.")
    if self.kv_quant not in ("none", "fp8_e4m3", "fp8_e5m2"):
      raise UserError(f"kv_quant={self.kv_quant!r}; choose none, fp8_e4m3 or fp8_e5m2.")
    if self.act_quant not in ("none", "fp8_e4m3", "int8"):
      raise UserError(f"act_quant={self.act_quant!r}; choose none, fp8_e4m3 or int8.")
    if self.kv_scale not in ("static", "per_head"):
      raise UserError(f"kv_scale={self.kv_scale!r}; choose static or per_head.")
    for _, fmt in self.recipe(num_layers=1) or []:
      perturb.QuantFormat.parse(fmt)

  def __str__(self):
    diff = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default and f.name not in ("noise_seed", "keep_edge_layers", "kv_scale")]
    return ",".join(diff) or "clean"

  def sources(self) -> dict[str, EngineView]:
    """Each perturbation of this view alone (for attribution)."""
    base = EngineView(keep_edge_layers=self.keep_edge_layers, kv_scale=self.kv_scale, noise_seed=self.noise_seed)
    out = {}
    for name, kw in (("lag", {"lag": self.lag}), ("noise", {"noise_sigma": self.noise_sigma}),
                     ("weights", {"weights": self.weights}), ("kv_cache", {"kv_quant": self.kv_quant}),
                     ("activations", {"act_quant": self.act_quant}),
                     ("compute", {"compute_dtype": self.compute_dtype})):
      single = dataclasses.replace(base, **kw)
      if single != base:
        out[name] = single
    return out

  def model(self, trainer_model: Model) -> Model:
    cfg = trainer_model.cfg.replace(dtype=self.compute_dtype, kv_quant=self.kv_quant, kv_scale=self.kv_scale,
                                    act_quant=self.act_quant)
    return Model(cfg)

  def recipe(self, num_layers: int) -> list[tuple[str, str]] | None:
    if self.weights == "fp32":
      return None
    if ">" in self.weights:
      return perturb.parse_recipe(self.weights)
    return perturb.preset(self.weights, num_layers, self.keep_edge_layers)

  def transform(self, params, num_layers: int, noise_step: int = 0, pack: bool = False):
    """Noise then quantization of (already lagged) params; jit-able, pure. With `pack`, FP8/INT8
    matrices stay quantized (`perturb.QArray`) for an engine that dequantizes on the fly."""
    if self.noise_sigma > 0:
      key = jax.random.fold_in(jax.random.key(self.noise_seed), noise_step)
      params = perturb.add_weight_noise(params, key, self.noise_sigma)
    recipe = self.recipe(num_layers)
    if recipe is not None:
      params = perturb.apply_recipe(params, recipe, pack=pack)
    return params


class ViewTransform:
  """Params as an engine view's engine holds them, compiled once for every sweep point: the noise
  transform takes sigma as a traced argument, and each distinct recipe compiles once. The caller
  picks the noise draw with `key` (the same key and sigma give `EngineView.transform`'s noise)."""

  def __init__(self, num_layers: int, pack: bool = False):
    self.num_layers, self.pack = num_layers, pack
    self._noise = jax.jit(lambda p, key, sigma: perturb.add_weight_noise(p, key, sigma))
    self._recipes: dict = {}

  def __call__(self, view: EngineView, params, key: jax.Array):
    if view.noise_sigma > 0:
      params = self._noise(params, key, jnp.float32(view.noise_sigma))
    recipe = view.recipe(self.num_layers)
    if recipe is not None:
      recipe = tuple(tuple(r) for r in recipe)
      if recipe not in self._recipes:
        self._recipes[recipe] = jax.jit(lambda p, r=recipe: perturb.apply_recipe(p, r, pack=self.pack))
      params = self._recipes[recipe](params)
    return params

  def compiled(self) -> dict[str, int]:
    return {"noise": self._noise._cache_size(), "recipes": sum(f._cache_size() for f in self._recipes.values())}
