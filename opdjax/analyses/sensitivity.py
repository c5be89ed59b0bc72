"""`opdjax sensitivity`: which layers and module kinds of one model are sensitive to weight rounding,
and the model-specific FP8 recipe that follows.

Tokens are sampled once by the clean model (the first `num_prompts` held-out prompts, the config's
rollout sampling and `sensitivity.seed`). Every sweep point then re-scores those same tokens with
perturbed weights: mismatch = masked mean over completion tokens of the exact full-vocabulary
KL(perturbed || clean), the `exact_kl` of `opdjax.mismatch` (engine = perturbed, trainer = clean).
The sweep perturbs one layer at a time (all of its matrices; its norms round to bf16, as in
`perturb.apply_recipe`) and one module kind at a time (`q_proj` ... `down_proj` in every layer,
`embed_tokens`, `lm_head`), once per format of `sensitivity.formats` and once with relative
Gaussian weight noise `noise_sigma`. Every point goes through one compiled KL function: perturbed
params keep the pytree structure and dtypes (fake quantization is fp32 quantize -> dequantize).

With tied embeddings (SmolLM2) one tensor is both the input lookup and the output projection:
`embed_tokens` perturbs only the lookup, `lm_head` only the projection (the KL function takes the
params of the body and of the output projection separately), and `tied_embedding` both, which is
what a recipe row `embed_tokens>...` does to such a model.

Recipe: layers ranked by their single-layer KL under `recipe_format`; the recipe keeps the k most
sensitive layers (and embeddings, lm_head, norms) in bf16 and every other matrix in
`recipe_format`, with the smallest k whose *measured* KL is <= `target_kl` (0: half the KL of
k = 0, every layer quantized, above the clean floor, which is 0 unless top-k/top-p truncate). At
the same k (the same weight memory: all layers are the same size) it is compared with common
practice, the first/last layers kept in bf16 (`perturb.preset`'s edge layers, generalised to any
k: first ceil(k/2), last floor(k/2)), and with random choices of k layers.
Details and measured numbers: docs/sensitivity.md. The recipe selection's pure functions are in
`sensitivity_recipe`, the report and plots in `sensitivity_report`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from opdjax.analyses import capacity
from opdjax.analyses.sensitivity_recipe import (
  edge_layers,
  rank,
  recipe_rows,
  recipe_spec,
  select_bf16_layers,
  spearman,
)
from opdjax.analyses.sensitivity_report import (
  report,  # noqa: F401 -- the CLI calls sensitivity.report
  tables,  # noqa: F401
  write_outputs,
)
from opdjax.errors import UserError
from opdjax.models import quant
from opdjax.models.decoder import Model
from opdjax.progress import bar as progress_bar
from opdjax.rollout import SamplingParams
from opdjax.rollout.deploy import jax_engine
from opdjax.rollout.sampling import sampling_logprobs
from opdjax.scoring.rescore import TrainBatch, batch_from_rollout, chunked_over_positions
from opdjax.views import perturb

ROLES = ("teacher", "student")
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8")
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
NUM_RANDOM = 3  # random same-memory recipes averaged


# --- settings ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Settings:
  """`cfg.sensitivity`, checked. `perturbations` are canonical format specs (`fp8_e4m3:channel`) and
  `noise:SIGMA`; the recipe format is always among them."""

  model: str = "teacher"
  perturbations: tuple[str, ...] = ("fp8_e4m3:channel", "fp8_e5m2:channel", "int8:channel", "noise:0.05")
  recipe_format: str = "fp8_e4m3:channel"
  target_kl: float = 0.0
  num_prompts: int = 64
  seed: int = 0

  @classmethod
  def from_config(cls, sc: ml_collections.ConfigDict) -> Settings:
    if sc.model not in ROLES:
      raise UserError(f"sensitivity.model={sc.model!r}: choose 'teacher' or 'student' (the model to analyse).")
    recipe = quant.QuantFormat.parse(sc.recipe_format)
    if recipe.name not in QUANTIZED:
      raise UserError(f"sensitivity.recipe_format={sc.recipe_format!r}: the recipe quantizes to one of"
                      f" {', '.join(QUANTIZED)} (e.g. 'fp8_e4m3:channel'); bf16 is what it keeps.")
    formats = [str(quant.QuantFormat.parse(f.strip())) for f in sc.formats.split(",") if f.strip()]
    if sc.noise_sigma < 0 or sc.target_kl < 0 or sc.num_prompts < 1:
      raise UserError("sensitivity.noise_sigma and target_kl must be >= 0 and num_prompts >= 1 (got"
                      f" {sc.noise_sigma}, {sc.target_kl}, {sc.num_prompts}).")
    points = list(dict.fromkeys([str(recipe), *formats]))
    if sc.noise_sigma > 0:
      points.append(f"noise:{sc.noise_sigma:g}")
    return cls(sc.model, tuple(points), str(recipe), float(sc.target_kl), int(sc.num_prompts), int(sc.seed))


def perturbed(params, patterns: Sequence[str], perturbation: str, key: jax.Array):
  """`params` with the modules matching `patterns` quantized (a format spec) or noised (`noise:SIGMA`);
  every other leaf is the same array object."""
  if perturbation.startswith("noise:"):
    return perturb.add_weight_noise(params, key, float(perturbation[len("noise:"):]), list(patterns))
  return perturb.apply_recipe(params, [(p, perturbation) for p in patterns])


def module_kinds(model: Model) -> list[tuple[str, str, str]]:
  """[(kind, pattern, side)]: `side` is which use of the tensor is perturbed: `both`, `in` (the
  body, including the embedding lookup) or `out` (the output projection; tied models only)."""
  kinds = [(name, f"*.{parent}.{name}", "both") for parent, name in PROJECTIONS]
  if model.cfg.tie_word_embeddings:
    return kinds + [("embed_tokens", "embed_tokens", "in"), ("lm_head", "embed_tokens", "out"),
                    ("tied_embedding", "embed_tokens", "both")]
  return kinds + [("embed_tokens", "embed_tokens", "both"), ("lm_head", "lm_head", "both")]


# --- scoring the same tokens -------------------------------------------------------------------

def _over_completions(model: Model, params_in, params_out, batch: TrainBatch, chunk: int, fn: Callable, *extra_BxN):
  """`fn(logits [B, C, V] fp32, *extra chunks)` chunked over the completion positions (the last N of L),
  with the body run on `params_in` and the logits formed with `params_out`."""
  h_BxLxD, _ = model.hidden(params_in, batch["tokens"], batch["positions"], batch["attention_mask"])
  h_BxNxD = h_BxLxD[:, h_BxLxD.shape[1] - batch["loss_mask"].shape[1]:]
  return chunked_over_positions(lambda h, *xs: fn(model.logits(params_out, h), *xs), chunk, h_BxNxD, *extra_BxN)


def _clean_logp(model: Model, temperature: float, chunk: int, params, batch: TrainBatch) -> jax.Array:
  """The clean model's fp32 log-probs `[B, N, V]` at the sampling temperature (the trainer side)."""
  return _over_completions(model, params, params, batch, chunk,
                           lambda logits: jax.nn.log_softmax(logits / temperature, axis=-1))


def _kl_to_clean(model: Model, sampling: SamplingParams, chunk: int, params_in, params_out, clean_logp_BxNxV,
                 batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
  """Per sequence, the masked sum over completion tokens of KL(perturbed engine || clean) (as
  `mismatch.exact_kl`) and the token count: `[B]` each, so both the pooled token mean and per-prompt
  values come from one compiled function."""

  def per_chunk(logits, logp):
    logq = sampling_logprobs(logits, sampling)
    q = jnp.exp(logq)
    return jnp.sum(jnp.where(q > 0, q * (logq - logp), 0.0), axis=-1)

  kl_BxN = _over_completions(model, params_in, params_out, batch, chunk, per_chunk, clean_logp_BxNxV)
  mask_BxN = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(kl_BxN * mask_BxN, axis=-1), jnp.sum(mask_BxN, axis=-1)


class Scorer:
  """KL(perturbed || clean) on one fixed batch of tokens: one compiled function for every params tree
  of the clean tree's structure and dtypes. The clean side's log-probs are computed once."""

  def __init__(self, model: Model, params, batch: TrainBatch, sampling: SamplingParams, chunk: int = 64):
    temp = sampling.temperature if sampling.temperature > 0 else 1.0
    self.model, self.clean = model, params
    self.batch = batch
    self.clean_logp = jax.jit(functools.partial(_clean_logp, model, temp, chunk))(params, batch)
    self.fn = jax.jit(functools.partial(_kl_to_clean, model, sampling, chunk))

  def kl(self, params_in, params_out=None) -> float:
    """The token mean over the batch; `params_out` (default `params_in`) computes the logits,
    `params_in` everything before."""
    sums_B, counts_B = self._rows(params_in, params_out)
    return float(sums_B.sum() / max(counts_B.sum(), 1.0))

  def kl_rows(self, params_in, params_out=None) -> np.ndarray:
    """Each sequence's token mean `[B]` (a sequence without completion tokens counts 0)."""
    sums_B, counts_B = self._rows(params_in, params_out)
    return sums_B / np.maximum(counts_B, 1.0)

  def _rows(self, params_in, params_out):
    out = params_in if params_out is None else params_out
    sums_B, counts_B = self.fn(params_in, out, self.clean_logp, self.batch)
    return np.asarray(sums_B, np.float64), np.asarray(counts_B, np.float64)


def sample_tokens(model: Model, params, prompts, sampling: SamplingParams, seed: int, max_len: int, pad_id: int,
                  eos_ids) -> TrainBatch:
  """The clean model's completions as a batch for re-scoring; `loss_mask` covers the completions `[B, N]`."""
  engine = jax_engine(model, params, max_len=max_len, pad_id=pad_id, eos_ids=eos_ids)
  rollout = engine.generate(prompts, sampling, seed=seed)
  full = batch_from_rollout(rollout)
  start = rollout.prompt_tokens.shape[1] - 1  # position P - 1 predicts the first completion token
  return {"tokens": full["tokens"], "positions": full["positions"], "attention_mask": full["attention_mask"],
          "loss_mask": full["loss_mask"][:, start:]}


# --- the analysis ------------------------------------------------------------------------------

def _mix(bf16_params, quant_params, bf16_layers: Sequence[int]):
  """The recipe's params from the all-bf16 and all-quantized trees: layer i's slices of the stacked
  decoder-layer params from the former if kept."""
  if not bf16_layers:
    return quant_params
  keep = np.asarray(sorted(bf16_layers))
  layers = jax.tree.map(lambda b, q: q.at[keep].set(b[keep]), bf16_params["layers"], quant_params["layers"])
  return {**quant_params, "layers": layers}


def analyse(model: Model, params, scorer: Scorer, settings: Settings, progress: bool = True) -> dict:
  """Every sweep point, the rankings and the recipe of one model; `scorer` holds the fixed tokens."""
  n = model.cfg.num_layers
  key = jax.random.key(settings.seed)
  kinds = module_kinds(model)
  points = settings.perturbations
  layer_kl = {p: [0.0] * n for p in points}
  kind_kl = {p: {} for p in points}
  bar = progress_bar(total=len(points) * (n + len(kinds)), desc="sensitivity sweep", enabled=progress)
  for p in points:
    for i in range(n):
      layer_kl[p][i] = scorer.kl(perturbed(params, [f"layers.{i}.*"], p, key))
      bar.update()
    for name, pattern, side in kinds:
      pp = perturbed(params, [pattern], p, key)
      kind_kl[p][name] = scorer.kl(pp if side != "out" else params, pp if side != "in" else params)
      bar.update()
  bar.close()

  fmt = settings.recipe_format
  has_lm_head = "lm_head" in params
  order = rank(layer_kl[fmt])
  # Every candidate recipe is one of these two trees layer by layer (`_mix`), bit for bit what
  # `perturb.apply_recipe(params, recipe_rows(...))` gives (tested).
  quant_all = perturb.apply_recipe(params, recipe_rows([], fmt, has_lm_head))
  bf16_all = perturb.apply_recipe(params, [("*", "bf16")])
  measured: dict[frozenset, float] = {}

  def measure(layers):
    ident = frozenset(layers)
    if ident not in measured:
      measured[ident] = scorer.kl(_mix(bf16_all, quant_all, sorted(ident)))
    return measured[ident]

  # The clean floor is 0 unless sampling truncates (top-k/top-p): KL(truncated || trainer) > 0.
  kl_clean = scorer.kl(params)
  kl_all_quant = measure([])
  target = settings.target_kl if settings.target_kl > 0 else kl_clean + 0.5 * (kl_all_quant - kl_clean)
  with progress_bar(desc="recipe search", enabled=progress) as bar:
    def measure_counted(layers):
      bar.update()
      return measure(layers)

    k, _, met = select_bf16_layers(order, measure_counted, target)
    grid = sorted(set(range(n + 1)) if n <= 12 else
                  {*range(5), *np.linspace(0, n, 9).round().astype(int).tolist()} | {k})
    curve = [{"k": j, "sensitivity_kl": measure_counted(sorted(order[:j])),
              "edge_kl": measure_counted(edge_layers(n, j))} for j in grid]
    rng = np.random.default_rng(settings.seed)
    random_sets = [sorted(rng.choice(n, k, replace=False).tolist()) for _ in range(NUM_RANDOM)]
    random_kls = [measure_counted(s) for s in random_sets]

  bf16_layers = sorted(order[:k])
  rows = recipe_rows(bf16_layers, fmt, has_lm_head)
  kind_names = [name for name, _, _ in kinds]
  kind_order = rank([kind_kl[fmt][name] for name in kind_names])
  return {
      "model": {"model_type": model.cfg.model_type, "num_layers": n, "hidden_size": model.cfg.hidden_size,
                "vocab_size": model.cfg.vocab_size, "tie_word_embeddings": model.cfg.tie_word_embeddings,
                "num_params": int(sum(x.size for x in jax.tree.leaves(params)))},
      "settings": dataclasses.asdict(settings),
      "num_tokens": int(jnp.sum(scorer.batch["loss_mask"])),
      "num_sequences": int(scorer.batch["loss_mask"].shape[0]),
      "kl_clean": kl_clean,
      "layers": [{"layer": i, **{p: layer_kl[p][i] for p in points}} for i in range(n)],
      "kinds": [{"kind": name, **{p: kind_kl[p][name] for p in points}} for name in kind_names],
      "ranking": {"format": fmt, "layers": order, "kinds": [kind_names[j] for j in kind_order]},
      # Does the layer ranking depend on the format? Spearman of each perturbation's layer KLs
      # against the recipe format's.
      "format_agreement": {p: spearman(layer_kl[p], layer_kl[fmt]) for p in points if p != fmt},
      "recipe": {"format": fmt, "k": k, "bf16_layers": bf16_layers, "target_kl": target,
                 "target_auto": settings.target_kl == 0, "target_met": met, "measured_kl": measure(bf16_layers),
                 "rows": [list(r) for r in rows], "weights": recipe_spec(rows),
                 "engine_view": "weights=" + recipe_spec(rows),
                 # Serving footprint (bf16 baseline, FP8/INT8 scales counted), as `opdjax kv-capacity` counts.
                 "weight_mib": capacity.weight_footprint(model.cfg, rows)["bytes"] / 2**20,
                 "kl_all_quantized": kl_all_quant, "kl_all_bf16": measure(list(range(n)))},
      "baselines": {
          "edge": {"bf16_layers": edge_layers(n, k), "kl": measure(edge_layers(n, k))},
          "random": {"bf16_layers": random_sets, "kls": random_kls, "kl": float(np.mean(random_kls))},
          "all_bf16_mib": capacity.weight_footprint(model.cfg, None)["bytes"] / 2**20},
      "curve": curve,
      "compiles": scorer.fn._cache_size(),
  }


def score_recipes(model: Model, params, scorer: Scorer, results: dict) -> dict:
  """The recipe's, the same-memory edge layers' and the random choices' KL re-measured on `scorer`'s
  tokens (other prompts than the ones the ranking was chosen on): {recipe_kl, edge_kl, random_kl}
  (token means) and the recipe's and edge layers' per-prompt token means (`*_kl_prompts`, for the
  study's paired interval over prompts)."""
  rec, base = results["recipe"], results["baselines"]
  quant_all = perturb.apply_recipe(params, recipe_rows([], rec["format"], "lm_head" in params))
  bf16_all = perturb.apply_recipe(params, [("*", "bf16")])
  kl = lambda layers: scorer.kl(_mix(bf16_all, quant_all, layers))  # noqa: E731
  rows = lambda layers: scorer.kl_rows(_mix(bf16_all, quant_all, layers)).tolist()  # noqa: E731
  return {"recipe_kl": kl(rec["bf16_layers"]), "edge_kl": kl(base["edge"]["bf16_layers"]),
          "random_kl": float(np.mean([kl(s) for s in base["random"]["bf16_layers"]])),
          "recipe_kl_prompts": rows(rec["bf16_layers"]), "edge_kl_prompts": rows(base["edge"]["bf16_layers"]),
          "num_prompts": int(scorer.batch["loss_mask"].shape[0]), "num_tokens": int(jnp.sum(scorer.batch["loss_mask"]))}


def compare(a: dict, b: dict) -> dict:
  """How two models' kind rankings agree: Spearman of the KLs over their common kinds, per perturbation."""
  kinds_a, kinds_b = {r["kind"]: r for r in a["kinds"]}, {r["kind"]: r for r in b["kinds"]}
  common = [k for k in kinds_a if k in kinds_b]
  points = [p for p in a["settings"]["perturbations"] if p in b["settings"]["perturbations"]]
  return {"kinds": common,
          "spearman": {p: spearman([kinds_a[k][p] for k in common], [kinds_b[k][p] for k in common]) for p in points},
          "top_kinds": {"a": a["ranking"]["kinds"][:3], "b": b["ranking"]["kinds"][:3]}}


def run(cfg: ml_collections.ConfigDict, out_dir: str | None = None, progress: bool = True) -> dict:
  """Loads `sensitivity.model`, samples the tokens, sweeps, builds the recipe; writes `out_dir`."""
  from opdjax.pipeline.build import load_model, make_task

  settings = Settings.from_config(cfg.sensitivity)
  t0 = time.time()
  task = make_task(cfg)
  model, params = load_model(settings.model, cfg, task)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)  # fake quant returns fp32
  prompts = task.eval_set()[0][: settings.num_prompts]
  sampling = cfg.rollout.sampling
  batch = sample_tokens(model, params, prompts, sampling, settings.seed, cfg.rollout.max_len, task.pad_id,
                        task.eos_ids)
  scorer = Scorer(model, params, batch, sampling, chunk=cfg.loss.chunk)
  results = analyse(model, params, scorer, settings, progress)
  # Held out: the next num_prompts evaluation prompts, never seen by the ranking or the recipe search.
  heldout = task.eval_set()[0][settings.num_prompts: 2 * settings.num_prompts]
  results["heldout"] = None
  if len(heldout):
    batch_h = sample_tokens(model, params, heldout, sampling, settings.seed + 1, cfg.rollout.max_len, task.pad_id,
                            task.eos_ids)
    results["heldout"] = score_recipes(model, params, Scorer(model, params, batch_h, sampling, chunk=cfg.loss.chunk),
                                       results)
  results["model"]["role"] = settings.model
  results["model"]["path"] = getattr(cfg, settings.model).path or f"demo {settings.model} (cached SFT model)"
  results["sampling"] = dataclasses.asdict(sampling)
  results["seconds"] = round(time.time() - t0, 1)
  if out_dir:
    results["files"] = write_outputs(results, out_dir)
  return results
