"""`opdjax prefix-shift`: where a perturbed engine's samples leave the clean engine's, and what it costs OPD.

The clean engine (the trainer's current params) and a perturbed engine (an `EngineView`: noise, FP8
weights, k-step-old params) generate from the same prompts with the same RNG stream, so their samples
are coupled: identical until the two distributions differ enough to flip one draw, independent-ish
after. Per view this reports where the pairs first differ, and splits the error of the OPD learning
signal in two:

With p the trainer's student, q the engine's distribution, t the teacher and, at each context,
A(y) = log t(y) - log p(y) held constant, four expected signals are gradients of the surrogate
`Σ_positions Σ_y stop_grad(coef_y) log p(y)` (exact over the vocabulary, masked, divided by the
clean rollout's token count):

- `clean`:   contexts sampled by p, coef = p A (the on-policy signal = -grad of KL(p || t) there);
- `raw`:     contexts sampled by q, coef = q A (no correction);
- `tis`:     contexts sampled by q, coef = q min(p/q, C) A (truncated importance sampling);
- `is_full`: contexts sampled by q, coef = p A (untruncated: what a perfect correction reaches).

(i) `per_token` = raw - is_full: the part importance weights remove; it lives on every position.
(ii) `prefix_shift` = is_full - clean: the contexts themselves differ; no per-token weight fixes it.
It is zero on positions whose context is shared, i.e. up to the first divergence (`*_shared`:
the same split restricted to those positions; `prefix_shift_shared` is exactly 0, tested).
The loss values get the same split: each signal's value is `Σ coef (-1)`, the expectation of the
sampled reverse-KL estimate `log p(y) - log t(y)` (for `clean`/`is_full`: the full-vocabulary
KL(p || t) at those contexts). Two floors: `floor_same_seed`, the clean engine against itself with the
same seed and prompts (the same random stream: what a view's numbers are when the view changes nothing, so
a view's divergence beyond it is caused by the view), and `noise_floor`, the clean engine with another
seed, i.e. unrelated samples: the largest prefix shift the same policy produces, an upper reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.analyses.mismatch import parse_views, warmup_history
from opdjax.analyses.prefix_shift_report import (
  RELATIVE,
  report,  # noqa: F401 -- the CLI calls prefix_shift.report
  write_outputs,
)
from opdjax.config.schema import Config
from opdjax.models.decoder import Model
from opdjax.pipeline.session import Session
from opdjax.progress import bar as progress_bar
from opdjax.rollout import SamplingParams
from opdjax.rollout.base import Rollout
from opdjax.rollout.jax.cache import EngineCache
from opdjax.rollout.sampling import sampling_logprobs
from opdjax.scoring.rescore import TrainBatch, batch_from_rollout, chunked_over_positions
from opdjax.views.history import ParamsHistory
from opdjax.views.view import EngineView, ViewTransform

# The signals one call computes on a batch: (coefficient kind, positions). The clean batch goes
# through the very same compiled function (its `p` rows are used), so a zero difference is exact.
SIGNALS = (("q", "all"), ("tis", "all"), ("p", "all"), ("q", "shared"), ("p", "shared"))
KINDS = tuple(k for k, _ in SIGNALS)
# Rows of [clean batch's signals ++ perturbed batch's signals] that the combinations below use.
_SIGNAL_INDEX = {"clean": 2, "clean_shared": 4, "raw": 5, "tis": 6, "is_full": 7, "raw_shared": 8,
                 "is_full_shared": 9}
# Each reported quantity is a linear combination of those signals.
COMBOS = {
    "clean": {"clean": 1},
    "raw": {"raw": 1},
    "tis": {"tis": 1},
    "is_full": {"is_full": 1},
    "per_token": {"raw": 1, "is_full": -1},
    "prefix_shift": {"is_full": 1, "clean": -1},
    "tis_residual": {"tis": 1, "is_full": -1},
    "total_raw": {"raw": 1, "clean": -1},
    "total_tis": {"tis": 1, "clean": -1},
    "per_token_shared": {"raw_shared": 1, "is_full_shared": -1},
    "prefix_shift_shared": {"is_full_shared": 1, "clean_shared": -1},
    "clean_shared": {"clean_shared": 1},
}
_COMBO_MATRIX = np.zeros((len(COMBOS), 2 * len(SIGNALS)), np.float32)
for _row, _combo in enumerate(COMBOS.values()):
  for _name, _c in _combo.items():
    _COMBO_MATRIX[_row, _SIGNAL_INDEX[_name]] = _c
# Reported relative to the clean signal (gradient norms, and signed loss values).


# --- divergence ----------------------------------------------------------------------------------

def first_divergence(a: Rollout, b: Rollout) -> np.ndarray:
  """Per sequence, the first completion index where the two differ (token or end), -1 if never.

  Two sequences that end with the same EOS at the same place are identical (padding is ignored).
  """
  if a.completion_tokens.shape != b.completion_tokens.shape or not np.array_equal(a.prompt_tokens, b.prompt_tokens):
    raise ValueError("rollouts to compare need the same prompts and max_new_tokens.")
  ta, tb = np.asarray(a.completion_tokens), np.asarray(b.completion_tokens)
  ma, mb = np.asarray(a.completion_mask), np.asarray(b.completion_mask)
  differ = (ma != mb) | (ma & (ta != tb))
  return np.where(differ.any(axis=1), differ.argmax(axis=1), -1)


def shared_mask(batch: TrainBatch, first_div: np.ndarray, num_new: int) -> jax.Array:
  """`loss_mask` kept where the context is shared: completion index j <= first divergence.

  At j = d the two contexts are still identical (only the token drawn there differs). Position
  i predicts token i + 1, so completion index j sits at position (L - num_new) + j.
  """
  length = batch["loss_mask"].shape[1]
  j = np.arange(length) - (length - num_new)
  d = np.where(first_div < 0, num_new, first_div)
  return batch["loss_mask"] * jnp.asarray(j[None, :] <= d[:, None], jnp.float32)


def divergence_stats(first_div: np.ndarray, clean_mask: np.ndarray, max_new: int) -> dict:
  """Fraction diverged, first-divergence quantiles (over diverged sequences) and histogram,
  and the fraction of the clean rollout's completion tokens whose context is shared."""
  clean_mask = np.asarray(clean_mask, bool)
  div = first_div[first_div >= 0]
  lengths = clean_mask.sum(axis=1)
  shared = np.where(first_div < 0, lengths, np.minimum(first_div + 1, lengths))
  q = (lambda x: float(np.quantile(div, x))) if div.size else (lambda x: None)
  return {
      "num_sequences": int(first_div.size),
      "frac_diverged": float(div.size / max(first_div.size, 1)),
      "first_div_p10": q(0.1), "first_div_median": q(0.5), "first_div_p90": q(0.9),
      "first_div_mean": float(div.mean()) if div.size else None,
      "first_div_hist": np.bincount(div, minlength=max_new)[:max_new].tolist(),
      "shared_token_frac": float(shared.sum() / max(lengths.sum(), 1)),
  }


# --- expected signals ------------------------------------------------------------------------------

def expected_signals(params, teacher_params, view_params, batch: TrainBatch, weights_KxBxL, *, student: Model,
                     teacher: Model, view: Model, sampling: SamplingParams, kinds: tuple[str, ...],
                     threshold: float, chunk: int = 128):
  """Gradients `[K, ...params]` and values `[K]` of the signals `kinds` (`p`, `q`, `tis`) on one batch.

  Signal k is the surrogate `Σ_pos w_k Σ_y stop_grad(coef_y) log p(y)`, weights `weights_KxBxL`
  (the mask divided by the normaliser), coef = c(y) A(y) with c = p, q or min(p, C q) and
  A = log t - log p. Its value is `Σ_pos w_k Σ_y c(y) (log p(y) - log t(y))`.
  """
  args = (batch["tokens"], batch["positions"], batch["attention_mask"])
  h_t = jax.lax.stop_gradient(teacher.hidden(teacher_params, *args)[0])
  h_q = jax.lax.stop_gradient(view.hidden(view_params, *args)[0])
  temp = sampling.temperature if sampling.temperature > 0 else 1.0

  def surrogate(p_params):
    h_s, _ = student.hidden(p_params, *args)

    def per_chunk(hs, ht, hq):
      logp = jax.nn.log_softmax(student.logits(p_params, hs).astype(jnp.float32) / temp, axis=-1)
      logt = jax.nn.log_softmax(teacher.logits(teacher_params, ht).astype(jnp.float32) / temp, axis=-1)
      logq = sampling_logprobs(view.logits(view_params, hq), sampling)
      lp = jax.lax.stop_gradient(logp)
      p, q = jnp.exp(lp), jnp.exp(logq)
      weight = {"p": p, "q": q, "tis": jnp.minimum(p, threshold * q)}  # q min(p/q, C), 0 where q = 0
      adv = logt - lp
      c = jnp.stack([jnp.where(weight[k] > 0, weight[k] * adv, 0.0) for k in kinds], axis=-2)  # [B, C, K, V]
      return jnp.einsum("bckv,bcv->bck", c, logp), -jnp.sum(c, axis=-1)

    surr, val = chunked_over_positions(per_chunk, chunk, h_s, h_t, h_q)
    w = jnp.moveaxis(weights_KxBxL, 0, -1)
    return jnp.sum(surr * w, axis=(0, 1)), jnp.sum(val * w, axis=(0, 1))

  out, vjp_fn, values = jax.vjp(surrogate, params, has_aux=True)
  # One backward pass per signal, in a loop (one compiled body). `jax.vmap(vjp_fn)` would batch them,
  # but under jit (JAX 0.10.2, CPU) it mixed the rows: the `p` rows' gradients changed with `view_params`.
  grads = jax.lax.map(lambda e: vjp_fn(e)[0], jnp.eye(out.shape[0], dtype=out.dtype))
  return grads, values


def combo_gram(grads_a, grads_b, combos_MxK):
  """Gram matrix `[M, M]` of the combinations `combos_MxK` of the stacked signals `a ++ b`.

  Differences are formed before the dot products, so a zero difference is exactly zero.
  """
  def leaf(xa, xb):
    x = jnp.concatenate([xa, xb], axis=0).reshape(xa.shape[0] + xb.shape[0], -1).astype(jnp.float32)
    v = jnp.einsum("mk,kn->mn", combos_MxK, x, precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("mn,ln->ml", v, v, precision=jax.lax.Precision.HIGHEST)

  return sum(jax.tree.leaves(jax.tree.map(leaf, grads_a, grads_b)))


# --- the analysis ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Measurement:
  divergence: dict
  grad: dict
  value: dict
  first_div: np.ndarray


class PrefixShift:
  """Couples a clean and a perturbed engine and measures the OPD signal's error; every jitted
  function takes params as arguments, so sweep points of one view model share one compilation."""

  def __init__(self, student: Model, teacher: Model, sampling: SamplingParams, *, max_len: int, pad_id: int,
               eos_ids, is_threshold: float = 2.0, chunk: int = 128, engines: EngineCache | None = None,
               views: ViewTransform | None = None):
    self.student, self.teacher, self.sampling = student, teacher, sampling
    self.is_threshold, self.chunk = is_threshold, chunk
    self.engines = engines or EngineCache(max_len=max_len, pad_id=pad_id, eos_ids=eos_ids)
    self._signals: dict = {}
    self.views = views or ViewTransform(student.cfg.num_layers)
    self.gram = jax.jit(combo_gram)

  def engine(self, vmodel: Model):
    return self.engines.get(vmodel)

  def signals_fn(self, vmodel: Model):
    if vmodel.cfg not in self._signals:
      self._signals[vmodel.cfg] = jax.jit(
          lambda p, tp, vp, b, w: expected_signals(p, tp, vp, b, w, student=self.student, teacher=self.teacher,
                                                   view=vmodel, sampling=self.sampling, kinds=KINDS,
                                                   threshold=self.is_threshold, chunk=self.chunk))
    return self._signals[vmodel.cfg]

  def view_params(self, view: EngineView, history: ParamsHistory):
    """`view.transform` of the lagged params, with sigma a traced argument (one compile for the sweep)."""
    _, params = history.lagged(view.lag)
    return self.views(view, params)

  def rollout(self, vmodel: Model, params, prompts, seed: int) -> Rollout:
    engine = self.engine(vmodel)
    engine.sync(params, 0)
    return engine.generate(prompts, self.sampling, seed=seed)

  def measure(self, clean: Rollout, other: Rollout, vmodel: Model, vparams, params, teacher_params) -> Measurement:
    """Divergence of `other` (sampled by `vmodel`/`vparams`) from `clean` (sampled by the trainer's
    `params`), and the signal errors, all normalised by the clean rollout's token count."""
    first_div = first_divergence(clean, other)
    b_clean, b_other = batch_from_rollout(clean), batch_from_rollout(other)
    n_clean = jnp.maximum(jnp.sum(b_clean["loss_mask"]), 1.0)
    shared = shared_mask(b_clean, first_div, clean.completion_tokens.shape[1])
    masks = {"all": None, "shared": shared}
    g_c, v_c = self.signals_fn(self.student)(params, teacher_params, params, b_clean, _weights(b_clean, masks, n_clean))
    g_o, v_o = self.signals_fn(vmodel)(params, teacher_params, vparams, b_other, _weights(b_other, masks, n_clean))
    gram = np.asarray(self.gram(g_c, g_o, jnp.asarray(_COMBO_MATRIX)), np.float64)
    values = _COMBO_MATRIX.astype(np.float64) @ np.concatenate([np.asarray(v_c), np.asarray(v_o)]).astype(np.float64)
    names = list(COMBOS)
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    ref_g, ref_v = norms[names.index("clean")], values[names.index("clean")]

    def cos(a, b):
      i, j = names.index(a), names.index(b)
      return float(gram[i, j] / max(norms[i] * norms[j], 1e-30))

    grad = {"clean_norm": float(ref_g)}
    grad.update({f"rel_{n}": float(norms[names.index(n)] / max(ref_g, 1e-30)) for n in RELATIVE})
    grad.update({f"cos_{n}_clean": cos(n, "clean") for n in ("raw", "tis", "is_full")})
    grad["cos_per_token_prefix_shift"] = cos("per_token", "prefix_shift")
    value = {n: float(values[names.index(n)]) for n in ("clean", "raw", "tis", "is_full")}
    value.update({f"rel_{n}": float(values[names.index(n)] / max(abs(ref_v), 1e-30)) for n in RELATIVE})
    stats = divergence_stats(first_div, np.asarray(clean.completion_mask), clean.completion_tokens.shape[1])
    return Measurement(stats, grad, value, first_div)


def _weights(batch: TrainBatch, masks: dict, denom) -> jax.Array:
  """`[K, B, L]` position weights of `SIGNALS` (`None` = the batch's own loss mask)."""
  return jnp.stack([batch["loss_mask"] if masks[pos] is None else masks[pos] for _, pos in SIGNALS]) / denom


def family(view: EngineView) -> tuple[str, float | str]:
  """`noise` (strength sigma), `lag` (k) or `other` (the view's spec) for plotting."""
  if view == EngineView(noise_sigma=view.noise_sigma) and view.noise_sigma > 0:
    return "noise", view.noise_sigma
  if view == EngineView(lag=view.lag) and view.lag > 0:
    return "lag", view.lag
  return "other", str(view)


FLOORS = ("floor_same_seed", "noise_floor")


def floor_jobs(seed: int) -> list[tuple[str, int]]:
  """The floors' (name, engine seed) against a clean rollout drawn with `seed` (module doc)."""
  return [("floor_same_seed", seed), ("noise_floor", seed + 1)]


def run(cfg: Config, out_dir: str | None = None, progress: bool = True, replicates: int = 1) -> dict:
  """`replicates` > 1: the whole measurement (clean rollout, noise floor, every view) repeated with
  seeds `prefix_shift.seed + 1000 r` on the same prompts and warmed-up params; each replicate's
  `grad` numbers go to `results["replicates"]` (replicate 0 is the main result)."""
  pc = cfg.prefix_shift
  views, max_lag = parse_views(pc.views, pc.warmup_steps, "prefix_shift")
  session = Session(cfg, progress=progress)
  task, student, teacher, teacher_params = session.task, session.student, session.teacher, session.teacher_params
  sampling = session.sampling
  state, history = warmup_history(session, pc.warmup_steps, max_lag)
  params = state.params
  loss_cfg = cfg.loss
  ps = PrefixShift(student, teacher, sampling, max_len=cfg.rollout.max_len, pad_id=task.pad_id, eos_ids=task.eos_ids,
                   is_threshold=loss_cfg.is_threshold, chunk=loss_cfg.chunk, engines=session.engines.jax_cache(),
                   views=session.views)
  prompts = task.eval_set()[0][: pc.num_prompts]
  clean = ps.rollout(student, params, prompts, pc.seed)
  results = {
      "config": {"views": [str(v) for v in views], "num_prompts": len(prompts), "seed": pc.seed,
                 "warmup_steps": pc.warmup_steps, "is_threshold": loss_cfg.is_threshold,
                 "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                 "clean_tokens": clean.num_tokens},
      "views": {},
  }
  # The floors (module doc): the clean engine on the same stream, and with another seed (unrelated samples).
  jobs = [(name, EngineView(), s) for name, s in floor_jobs(pc.seed)] + [(str(v), v, pc.seed) for v in views]
  for name, view, seed in progress_bar(jobs, desc="prefix-shift views", enabled=progress):
    vmodel, vparams = view.model(student), ps.view_params(view, history)
    m = ps.measure(clean, ps.rollout(vmodel, vparams, prompts, seed), vmodel, vparams, params, teacher_params)
    fam, strength = family(view) if name not in FLOORS else ("floor", 0.0)
    row = {"view": name, "family": fam, "strength": strength, "divergence": m.divergence, "grad": m.grad,
           "value": m.value}
    if name in FLOORS:
      results[name] = row
    else:
      results["views"][name] = row
  results["clean"] = {"grad_norm": results["noise_floor"]["grad"]["clean_norm"],
                      "reverse_kl": results["noise_floor"]["value"]["clean"]}
  results["replicates"] = [{"seed": pc.seed, **{r["view"]: r["grad"] for r in (*(results[f] for f in FLOORS),
                                                                              *results["views"].values())}}]
  for r in range(1, replicates):
    seed = pc.seed + 1000 * r
    clean_r = ps.rollout(student, params, prompts, seed)
    rep = {"seed": seed}
    for name, view, s in [(f, EngineView(), fs) for f, fs in floor_jobs(seed)] + [(str(v), v, seed) for v in views]:
      vmodel, vparams = view.model(student), ps.view_params(view, history)
      rep[name] = ps.measure(clean_r, ps.rollout(vmodel, vparams, prompts, s), vmodel, vparams, params,
                             teacher_params).grad
    results["replicates"].append(rep)
  if out_dir:
    write_outputs(results, out_dir)
  return results
