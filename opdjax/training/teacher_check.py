"""Teacher-side mismatch: a served teacher's answer (teacher.serve='vllm') against the same teacher at the
trainer's precision, on the same tokens. The served teacher's server has a precision of its own (bf16, FP8
weights and KV cache on a GPU), so the supervision the student follows carries a mismatch too. It is a
biased target, not an importance-weight problem: nothing was sampled from the teacher, so no correction
of the rollout (TIS, MIS) touches it; the student is pulled toward the served teacher's distribution.

On the batch's completion targets (the loss mask), with Δ = log p_served(y) - log p_ref(y):
- `teacher_mismatch_abs_mean`, `teacher_mismatch_abs_max`: mean and max |Δ| on the sampled tokens.
- `teacher_mismatch_half_sq`: the mean of Δ²/2, the second-order estimate of the KL between the two
  teachers on these positions (KL(p || q) ≈ E[(log p - log q)²]/2 for nearby p, q): the teacher-side
  deviation on the scale of a mismatch budget (opdjax.pipeline.teacher_preflight).
- with the served top-K (topk_rkl): `teacher_mismatch_topk_overlap`, the mean share of the served top-K that
  the reference's top-K holds too; `teacher_mismatch_topk_kl`, KL(served || reference) over the served
  top-K plus one tail bucket a side (the loss's own rule, opdjax.training.loss.served_terms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from opdjax.models.decoder import Model
from opdjax.scoring.rescore import TrainBatch, chunked_over_positions, masked_mean
from opdjax.training.loss import TAIL_FLOOR, mass_outside


@functools.partial(jax.jit, static_argnums=0)
def teacher_deviation(ref: Model, ref_params, batch: TrainBatch, answer: dict) -> dict[str, jax.Array]:
  """`teacher_mismatch_*` of a served answer (`teacher_logprobs`, and `teacher_topk_*` when present) against
  the reference teacher `ref` (the trainer's precision) on `batch`'s tokens."""
  mask = batch["loss_mask"]
  h, _ = ref.hidden(ref_params, batch["tokens"], batch["positions"], batch["attention_mask"])
  k = answer["teacher_topk_ids"].shape[-1] if "teacher_topk_ids" in answer else 0

  def per_chunk(h_c, tgt_c, ids_c, lpt_c):
    logp = jax.nn.log_softmax(ref.logits(ref_params, h_c).astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logp, tgt_c[..., None], axis=-1)[..., 0]
    if not k:
      return lp, lp, lp
    ref_k = jnp.take_along_axis(logp, ids_c, axis=-1)
    kth = jax.lax.top_k(logp, k)[0][..., -1:]
    overlap = jnp.mean((ref_k >= kth).astype(jnp.float32), axis=-1)
    tail_sv = jnp.maximum(mass_outside(lpt_c), TAIL_FLOOR)
    tail_ref = jnp.maximum(mass_outside(ref_k), TAIL_FLOOR)
    kl = jnp.sum(jnp.exp(lpt_c) * (lpt_c - ref_k), axis=-1) + tail_sv * (jnp.log(tail_sv) - jnp.log(tail_ref))
    return lp, overlap, kl

  ids = answer.get("teacher_topk_ids", batch["targets"][..., None])
  lpt = answer.get("teacher_topk_logprobs", jnp.zeros(ids.shape, jnp.float32))
  lp, overlap, kl = chunked_over_positions(per_chunk, 64, h, batch["targets"], ids, lpt)
  delta = jnp.abs(answer["teacher_logprobs"] - lp) * mask
  out = {"teacher_mismatch_abs_mean": masked_mean(delta, mask), "teacher_mismatch_abs_max": jnp.max(delta),
         "teacher_mismatch_half_sq": masked_mean(0.5 * delta**2, mask)}
  if k:
    out["teacher_mismatch_topk_overlap"] = masked_mean(overlap, mask)
    out["teacher_mismatch_topk_kl"] = masked_mean(kl, mask)
  return out
