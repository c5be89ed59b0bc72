"""Engine views: how the rollout engine differs from the trainer, and the params it samples with.

`EngineView` names the perturbations (lag, noise, weight quantization, compute dtype, KV and
activation rounding); `ViewTransform` turns trainer params into the engine's params, compiled once
per recipe with the noise sigma traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from opdjax import seeds
from opdjax.errors import UserError
from opdjax.models import quant
from opdjax.models.decoder import Model
from opdjax.views import perturb


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
      quant.QuantFormat.parse(fmt)

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

  def noise_key(self, seed: int, version: int) -> jax.Array:
    """The noise draw of params `version` in a run with `seed` (opdjax.seeds' one rule)."""
    return seeds.key(seed, version, "noise", self.noise_seed)

  def transform(self, params, num_layers: int, version: int = 0, pack: bool = False, seed: int = 0):
    """Noise then quantization of (already lagged) params; jit-able, pure. With `pack`, FP8/INT8
    matrices stay quantized (`quant.QArray`) for an engine that dequantizes on the fly."""
    if self.noise_sigma > 0:
      params = perturb.add_weight_noise(params, self.noise_key(seed, version), self.noise_sigma)
    recipe = self.recipe(num_layers)
    if recipe is not None:
      params = perturb.apply_recipe(params, recipe, pack=pack)
    return params


class ViewTransform:
  """The one view -> engine params function: params as a view's engine holds them, compiled once
  for every sweep point (sigma is a traced argument; each distinct recipe compiles once per packing).
  `ViewTransform(n)(view, params, version, seed, pack)` equals `view.transform(params, n, version,
  pack, seed)`."""

  def __init__(self, num_layers: int):
    self.num_layers = num_layers
    self._noise = jax.jit(lambda p, key, sigma: perturb.add_weight_noise(p, key, sigma))
    self._recipes: dict = {}

  def __call__(self, view: EngineView, params, version: int = 0, seed: int = 0, pack: bool = False):
    if view.noise_sigma > 0:
      params = self._noise(params, view.noise_key(seed, version), jnp.float32(view.noise_sigma))
    recipe = view.recipe(self.num_layers)
    if recipe is not None:
      recipe = (tuple(tuple(r) for r in recipe), pack)
      if recipe not in self._recipes:
        self._recipes[recipe] = jax.jit(lambda p, r=recipe[0]: perturb.apply_recipe(p, r, pack=pack))
      params = self._recipes[recipe](params)
    return params

  def compiled(self) -> dict[str, int]:
    return {"noise": self._noise._cache_size(), "recipes": sum(f._cache_size() for f in self._recipes.values())}
