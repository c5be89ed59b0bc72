"""`opdjax plan --schedule`: the steady-state step time of sync colocated, sync disaggregated and
async k (exact, bounded) from per-stage costs, and the rollout/training device split minimising it.

Stages of a step (seconds): the producer's `generate` g, `prepare` p (the objective's inputs) and
`load` l (installing a params version), the trainer's `train` t and `export` x (publishing the
params: copy, export, transfer). The algebra (the loop of opdjax.pipeline: exact mode's data
dependency, bounded mode's admission rule; `simulate` runs it event by event):

  sync (either placement)   step = g + p + l + t + x        each side waits while the other works
  async k >= 1, exact       step = max(g + p + l, t + x)    rollout t needs version t - k: the
                                                            producer runs up to k steps ahead
  async k >= 1, bounded     the same period; the lag is k behind a fast producer, less behind a slow one

Colocated and disaggregated differ in the costs, not the algebra: colocated, each stage has every
device (and the engine's copy is a local copy); disaggregated, g, p, l run on the rollout devices,
t, x on the trainer's, and x moves the weights over the link between them.

Costs come from either
- measured records (`--measure RUN ...`: metrics.jsonl of timed or asynchronous runs, whose time
  split opdjax.pipeline.loop.Timing writes; medians after the first steps), or
- a model: FLOPs from the model configs (6ND-style counts plus attention; XLA's cost analysis of the
  compiled, layer-scanned step counts a loop body once, so it is not used here) and bytes (weights,
  KV cache) against a device table of peak FLOP/s and HBM bandwidth with efficiency factors, the
  weight sync's bytes over a link bandwidth. A layout whose memory does not fit (analytic, per
  device) is an error naming the fix; `opdjax plan` (without --schedule) compiles it to check exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from opdjax.errors import UserError
from opdjax.pipeline import overlap

GIB = 1 << 30

# Dense peak FLOP/s (no sparsity), HBM bytes/s, HBM bytes, link bytes/s between the trainer's and the
# engine's devices (inter-node: one NIC a GPU), each from the vendor's public datasheet.
DEVICES = {
    "h100-sxm": {"bf16_flops": 989.4e12, "fp8_flops": 1978.9e12, "hbm_bw": 3.35e12, "hbm_bytes": 80e9,
                 "link_bw": 50e9,
                 "source": "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): SXM5 BF16"
                           " 989.4 TFLOPS and FP8 1,978.9 TFLOPS dense (half the sparsity figures), HBM3 3.35 TB/s,"
                           " 80 GB; link: ConnectX-7 NDR InfiniBand 400 Gb/s a GPU"},
    "h200": {"bf16_flops": 989.4e12, "fp8_flops": 1978.9e12, "hbm_bw": 4.8e12, "hbm_bytes": 141e9,
             "link_bw": 50e9,
             "source": "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): SXM BF16 989.4"
                       " TFLOPS and FP8 1,978.9 TFLOPS dense, HBM3e 4.8 TB/s, 141 GB; link: NDR InfiniBand"
                       " 400 Gb/s a GPU"},
    "tpu-v5e": {"bf16_flops": 197e12, "fp8_flops": None, "hbm_bw": 819e9, "hbm_bytes": 16e9, "link_bw": 200e9,
                "source": "Google Cloud TPU v5e documentation (cloud.google.com/tpu/docs/v5e): 197 TFLOPS bf16,"
                          " 394 TOPS int8 (no fp8), HBM2 16 GiB at 819 GB/s, ICI 1,600 Gbps a chip"},
}
# Fractions of the peaks reached (assumptions, not measurements: override with --efficiency). Train:
# typical dense-LLM MFU at this scale; prefill: a large matmul batch; decode: weight and KV reads.
EFFICIENCY = {"train": 0.40, "prefill": 0.50, "decode_bw": 0.60}


@dataclasses.dataclass(frozen=True)
class Costs:
  """Seconds a step of each stage (see the module doc)."""

  generate: float
  train: float
  prepare: float = 0.0
  load: float = 0.0
  export: float = 0.0

  @property
  def producer(self) -> float:
    return self.generate + self.prepare + self.load

  @property
  def trainer(self) -> float:
    return self.train + self.export


def sync_step(c: Costs) -> float:
  return c.producer + c.trainer


def async_step(c: Costs, k: int = 1) -> float:
  """Steady state of either mode, k >= 1: the larger side (see `simulate` for the derivation)."""
  if k < 1:
    return sync_step(c)
  return max(c.producer, c.trainer)


def simulate(c: Costs, k: int, mode: str = "exact", steps: int = 64) -> dict:
  """The loop's schedule event by event: the trainer publishes version s (`export`), waits for rollout
  s, trains; the producer starts rollout r once rollout r - 1 is done, version r - k is published and
  the queue has room (rollout r - k taken), with version r - k (exact) or the newest published
  (bounded). Returns the steady-state period (median of the second half's steps) and mean lag."""
  publish, take, end, ready, lags = [], [], [], [], []
  t_end = 0.0
  for s in range(steps):
    publish.append(t_end + c.export)
    r = s  # the producer's rollout s, from what is known once version s is published
    need = max(r - k, 0)
    start = max(ready[r - 1] if r else 0.0, publish[need], take[r - k] if r - k >= 0 else 0.0)
    version = need if mode == "exact" else max(v for v, p in enumerate(publish) if p <= start)
    ready.append(start + c.producer)
    lags.append(s - version)
    take.append(max(publish[s], ready[s]))
    t_end = take[s] + c.train
    end.append(t_end)
  periods = [b - a for a, b in zip(end[steps // 2:], end[steps // 2 + 1:])]
  return {"step_s": statistics.median(periods), "lag_mean": statistics.fmean(lags[steps // 2:])}


# --- measured costs ------------------------------------------------------------------------------

def read_records(path: str) -> list[dict]:
  file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise UserError(f"--measure {path!r}: no metrics.jsonl there; give a run folder (opdjax train --out) or its"
                    " metrics.jsonl, of a timed or asynchronous run.")
  with open(file) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  if not any("time_train_s" in r for r in recs):
    raise UserError(f"{file} has no time split (time_train_s): it is a synchronous run without timing; run it with"
                    " rollout.async_depth > 0, or timed (run_loop(..., timed=True)).")
  return recs


def measured_costs(records: list[dict], skip: int = 2) -> tuple[Costs, dict]:
  """Costs from a run's time split (medians after `skip` timed steps), and what the run measured:
  its depth, its step time (median of the wall clock's steps) and its overlap fields."""
  timed = [r for r in records if "time_train_s" in r][skip:]
  if not timed:
    raise UserError(f"the run has {len(records)} records, none timed after the first {skip}: run more steps.")
  med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
  depth = int(timed[0].get("async_depth", 0))
  if depth:  # the trainer's export is in time_train_s (publish); the producer loaded
    costs = Costs(generate=med("time_generate_s"), prepare=med("time_prepare_s"),
                  load=statistics.median(overlap.generate_side(r) - r.get("time_generate_s", 0.0)
                                         - r.get("time_prepare_s", 0.0) for r in timed),
                  train=med("time_train_s") - med("time_publish_s"), export=med("time_publish_s"))
  else:  # one thread: export and load are one weight sync, between the two sides
    costs = Costs(generate=med("time_generate_s"), prepare=med("time_prepare_s"), load=med("time_weight_sync_s"),
                  train=med("time_train_s"))
  walls = [r["wall_s"] for r in records if "wall_s" in r]
  steps = [b - a for a, b in zip(walls[skip:], walls[skip + 1:])]
  summary = overlap.summary(records, skip)
  return costs, {"async_depth": depth, "steps": len(timed),
                 "step_s": statistics.median(steps) if steps else summary.get("step_s"),
                 "overlap_efficiency": summary.get("overlap_efficiency")}


def predict_measured(paths: list[str], k: int = 1, fp8_generate_speedup: float = 1.0) -> dict:
  """Predictions from each run's measured costs (their own placement) and, where a run of the other
  kind is given too, its measured step beside the prediction."""
  runs = []
  for path in paths:
    costs, measured = measured_costs(read_records(path))
    if fp8_generate_speedup != 1.0:
      costs = dataclasses.replace(costs, generate=costs.generate / fp8_generate_speedup)
    runs.append({"path": path, "costs": dataclasses.asdict(costs), "measured": measured,
                 "predicted": {"sync_s": sync_step(costs), f"async_k{k}_s": async_step(costs, k),
                               "async_bounded_lag_mean": simulate(costs, k, "bounded")["lag_mean"],
                               "speedup_async_over_sync": sync_step(costs) / async_step(costs, k),
                               "overlap_speedup_bound": overlap.speedup_bound(costs.producer, costs.trainer)}})
  out = {"mode": "measured", "k": k, "fp8_generate_speedup": fp8_generate_speedup, "runs": runs, "checks": []}
  # Each run's costs predict the other kind's step (the same placement assumed): the validation.
  for a in runs:
    for b in runs:
      if a is b or bool(a["measured"]["async_depth"]) == bool(b["measured"]["async_depth"]):
        continue
      key = f"async_k{k}_s" if b["measured"]["async_depth"] else "sync_s"
      pred, meas = a["predicted"][key], b["measured"]["step_s"]
      out["checks"].append({"costs_of": a["path"], "predicts": b["path"], "predicted_s": pred, "measured_s": meas,
                            "error": pred / meas - 1})
  return out


# --- modelled costs ------------------------------------------------------------------------------

def matmul_params(cfg) -> int:
  """Parameters multiplied per token (every projection and the LM head; embeddings are a gather)."""
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layer = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
  return cfg.num_layers * layer + cfg.hidden_size * cfg.vocab_size


def total_params(cfg) -> int:
  return matmul_params(cfg) + (0 if cfg.tie_word_embeddings else cfg.hidden_size * cfg.vocab_size)


def forward_flops(cfg, tokens: int, context: float) -> float:
  """A forward over `tokens` tokens attending to `context` positions on average."""
  attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # QK^T and AV, per token
  return tokens * (2 * matmul_params(cfg) + attn)


def kv_bytes_per_token(cfg, kv_bytes: int) -> int:
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_bytes


@dataclasses.dataclass(frozen=True)
class Layout:
  teacher: object  # ModelConfig
  student: object
  devices: int
  device: str = "h100-sxm"
  batch: int = 64
  seq_len: int = 1024
  prompt_len: int = 512
  fp8: bool = False  # the engine's weights and KV in FP8 (a GPU with FP8 tensor cores)
  remat: str = "full"
  efficiency: tuple = tuple(EFFICIENCY.items())

  @property
  def eff(self) -> dict:
    return dict(self.efficiency)

  @property
  def spec(self) -> dict:
    return DEVICES[self.device]


def train_seconds(lay: Layout, n: int) -> float:
  d, tokens, ctx = lay.spec, lay.batch * (lay.seq_len - 1), lay.seq_len / 2
  student = forward_flops(lay.student, tokens, ctx)
  flops = student * (4 if lay.remat == "full" else 3) + forward_flops(lay.teacher, tokens, ctx)
  return flops / (n * d["bf16_flops"] * lay.eff["train"])


def train_bytes_per_device(lay: Layout, n: int) -> float:
  """FSDP over n: fp32 params, grads and two Adam moments (16 B a param), the teacher in bf16, the
  layer inputs remat keeps and one logits chunk (bf16 activations)."""
  rows = math.ceil(lay.batch / n)
  acts = rows * lay.seq_len * lay.student.hidden_size * lay.student.num_layers * 2
  logits = rows * 128 * lay.student.vocab_size * 4 * 3
  return (16 * total_params(lay.student) + 2 * total_params(lay.teacher)) / n + acts + logits


def engine_shape(lay: Layout, n: int) -> tuple[int, int, float]:
  """(engines, tensor-parallel size, bytes a device) for the engine on n devices: the smallest
  power-of-two tensor parallelism whose weights and KV cache fit, as many engines as that leaves."""
  wbytes = 1 if lay.fp8 else 2
  for tp in (1, 2, 4, 8, 16):
    if tp > n:
      break
    engines = n // tp
    rows = math.ceil(lay.batch / engines)
    need = (total_params(lay.student) * wbytes + rows * lay.seq_len * kv_bytes_per_token(lay.student, wbytes)) / tp
    if need <= 0.9 * lay.spec["hbm_bytes"]:
      return engines, tp, need
  raise UserError(f"the student's engine does not fit on {n} {lay.device} device(s) (weights and the KV cache of"
                  f" {lay.batch} x {lay.seq_len} tokens); give the rollout more devices, a smaller --batch or"
                  " --seq-len, or --fp8.")


def generate_seconds(lay: Layout, n: int) -> float:
  """Prefill at the prefill efficiency, then one decode step per new token bound by the larger of
  its reads (weights, the average KV context) and its FLOPs, on `engines` data-parallel engines."""
  d, e = lay.spec, lay.eff
  engines, tp, _ = engine_shape(lay, n)
  rows = math.ceil(lay.batch / engines)
  peak = d["fp8_flops"] if lay.fp8 and d["fp8_flops"] else d["bf16_flops"]
  wbytes = 1 if lay.fp8 else 2
  new = lay.seq_len - lay.prompt_len
  prefill = forward_flops(lay.student, rows * lay.prompt_len, lay.prompt_len / 2) / (tp * peak * e["prefill"])
  ctx = lay.prompt_len + new / 2
  reads = total_params(lay.student) * wbytes + rows * ctx * kv_bytes_per_token(lay.student, wbytes)
  per_token = max(reads / (tp * d["hbm_bw"] * e["decode_bw"]),
                  forward_flops(lay.student, rows, ctx) / (tp * peak * e["prefill"]))
  return prefill + new * per_token


def sync_seconds(lay: Layout, n_rollout: int | None) -> float:
  """The weight sync: the engine's weights over the link (disaggregated: each engine receives the
  model over its devices' links) or copied within HBM (colocated, `n_rollout` None)."""
  wbytes = total_params(lay.student) * (1 if lay.fp8 else 2)
  if n_rollout is None:
    return 2 * wbytes / lay.devices / lay.spec["hbm_bw"]  # read and write each device's share
  _, tp, _ = engine_shape(lay, n_rollout)
  return wbytes / (tp * lay.spec["link_bw"])


def check_train_fits(lay: Layout, n: int, extra: float = 0.0, what: str = "the trainer") -> None:
  need = train_bytes_per_device(lay, n) + extra
  if need > 0.9 * lay.spec["hbm_bytes"]:
    raise UserError(f"{what} on {n} {lay.device} device(s) needs about {need / GIB:.1f} GiB a device (fp32 student,"
                    f" grads and Adam, bf16 teacher, activations), over 90% of {lay.spec['hbm_bytes'] / GIB:.0f} GiB;"
                    " give it more devices, a smaller --batch or --seq-len (`opdjax plan` compiles the trainer for"
                    " an exact figure).")


def predict_modelled(lay: Layout, k: int = 1, rollout_devices: int = 0) -> dict:
  """Every split (or `rollout_devices`): sync disaggregated and async; colocated on every device."""
  if lay.devices < 2:
    raise UserError(f"--devices {lay.devices}: a disaggregated layout needs at least 2 devices (one a side).")
  colocated = None
  try:  # the engine and the trainer both in every device's memory
    _, _, engine_bytes = engine_shape(lay, lay.devices)
    check_train_fits(lay, lay.devices, engine_bytes, "the colocated trainer and engine")
    colocated = Costs(generate=generate_seconds(lay, lay.devices), train=train_seconds(lay, lay.devices),
                      load=sync_seconds(lay, None))
  except UserError as e:
    colocated_error = str(e)
  splits, errors = [], []
  for r in ([rollout_devices] if rollout_devices else range(1, lay.devices)):
    try:
      check_train_fits(lay, lay.devices - r)
      w = sync_seconds(lay, r)
      c = Costs(generate=generate_seconds(lay, r), train=train_seconds(lay, lay.devices - r), load=w, export=w)
    except UserError as e:
      errors.append(str(e))
      continue
    splits.append({"rollout_devices": r, "trainer_devices": lay.devices - r, "costs": dataclasses.asdict(c),
                   "sync_disaggregated_s": sync_step(c) - w,  # one transfer when nothing overlaps
                   f"async_k{k}_s": async_step(c, k), "bounded_lag_mean": simulate(c, k, "bounded")["lag_mean"]})
  if not splits:
    raise UserError(errors[-1])
  best_async = min(splits, key=lambda s: s[f"async_k{k}_s"])
  best_sync = min(splits, key=lambda s: s["sync_disaggregated_s"])
  out = {"mode": "modelled", "k": k, "layout": {**{f.name: getattr(lay, f.name) for f in dataclasses.fields(lay)
                                                  if f.name not in ("teacher", "student", "efficiency")},
                                               "efficiency": lay.eff, "source": lay.spec["source"]},
         "splits": splits, "best_async": best_async, "best_sync_disaggregated": best_sync,
         "speedup_async_vs_sync_disaggregated": best_sync["sync_disaggregated_s"] / best_async[f"async_k{k}_s"],
         "speedup_async_vs_sync_disaggregated_same_split": (best_async["sync_disaggregated_s"]
                                                            / best_async[f"async_k{k}_s"])}
  if colocated is not None:
    out["sync_colocated_s"] = sync_step(colocated)
    out["colocated_costs"] = dataclasses.asdict(colocated)
    out["speedup_async_vs_sync_colocated"] = out["sync_colocated_s"] / best_async[f"async_k{k}_s"]
  else:
    out["sync_colocated_error"] = colocated_error
  return out


def parse_efficiency(text: str) -> dict:
  """'train=0.35,decode_bw=0.5' over EFFICIENCY's defaults."""
  out = dict(EFFICIENCY)
  for part in filter(None, (p.strip() for p in text.split(","))):
    k, eq, v = part.partition("=")
    try:
      value = float(v)
    except ValueError:
      value = -1.0
    if k not in EFFICIENCY or not eq or not 0 < value <= 1:
      raise UserError(f"--efficiency {text!r}: give name=fraction pairs in (0, 1] out of {', '.join(EFFICIENCY)},"
                      " e.g. 'train=0.35,decode_bw=0.5'.")
    out[k] = value
  return out


def modelled(teacher: str, student: str, *, devices: int, device: str, batch: int, seq_len: int, prompt_len: int,
             fp8: bool = False, remat: str = "full", efficiency: str = "", rollout_devices: int = 0,
             k: int = 1) -> dict:
  """`predict_modelled` for model names or folders (opdjax.analyses.capacity.load_model_config)."""
  from opdjax.analyses.capacity import load_model_config

  if device not in DEVICES:
    raise UserError(f"--device {device!r}; choose one of {', '.join(DEVICES)}.")
  if fp8 and not DEVICES[device]["fp8_flops"]:
    raise UserError(f"--fp8 on {device}: it has no FP8 matmuls; leave --fp8 out, or pick an FP8 GPU (h100-sxm, h200).")
  if not 0 <= rollout_devices < devices:
    raise UserError(f"--rollout-devices {rollout_devices}: give 1 to {devices - 1} of the {devices} devices (the"
                    " trainer takes the rest), or 0 to try every split.")
  lay = Layout(load_model_config(teacher)[1], load_model_config(student)[1], devices, device, batch, seq_len,
               prompt_len, fp8, remat, tuple(parse_efficiency(efficiency).items()))
  out = predict_modelled(lay, k, rollout_devices)
  out["layout"].update(teacher=teacher, student=student)
  return out


# --- report --------------------------------------------------------------------------------------

def _ms(x: float) -> str:
  return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def report(result: dict) -> str:
  k = result["k"]
  if result["mode"] == "measured":
    lines = [f"opdjax plan --schedule (measured costs; async k={k}, predicted steady state)"]
    for run in result["runs"]:
      c, m, p = run["costs"], run["measured"], run["predicted"]
      kind = f"async k={m['async_depth']}" if m["async_depth"] else "sync (timed)"
      lines += [f"  {run['path']} ({kind}, {m['steps']} timed steps)",
                "    costs: " + ", ".join(f"{n} {_ms(v)}" for n, v in c.items()),
                f"    predicted: sync {_ms(p['sync_s'])}, async k={k} {_ms(p[f'async_k{k}_s'])} (x"
                f"{p['speedup_async_over_sync']:.2f}; perfect overlap bound x{p['overlap_speedup_bound']:.2f}),"
                f" bounded lag {p['async_bounded_lag_mean']:.2f}",
                f"    measured: step {_ms(m['step_s'])}" + (f", overlap efficiency {m['overlap_efficiency']:.2f}"
                                                            if m["overlap_efficiency"] is not None else "")]
    for c in result["checks"]:
      lines.append(f"  {c['costs_of']}'s costs predict {c['predicts']}: {_ms(c['predicted_s'])} a step, measured"
                   f" {_ms(c['measured_s'])} ({100 * c['error']:+.0f}%)")
    return "\n".join(lines)
  lay, ba, bs = result["layout"], result["best_async"], result["best_sync_disaggregated"]
  lines = [f"opdjax plan --schedule (modelled, predicted): {lay['devices']} x {lay['device']}, batch {lay['batch']} x"
           f" {lay['seq_len']} (prompt {lay['prompt_len']}){', FP8 engine' if lay['fp8'] else ''}; async k={k}",
           f"  efficiency {lay['efficiency']}; device: {lay['source']}", "",
           f"  {'rollout/trainer':<17}{'generate':>11}{'train':>11}{'sync':>10}{'sync disagg':>13}"
           f"{f'async k={k}':>11}"]
  for s in result["splits"]:
    c = s["costs"]
    lines.append(f"  {s['rollout_devices']:>2} / {s['trainer_devices']:<12}{_ms(c['generate']):>11}"
                 f"{_ms(c['train']):>11}{_ms(c['load']):>10}{_ms(s['sync_disaggregated_s']):>13}"
                 f"{_ms(s[f'async_k{k}_s']):>11}")
  lines.append("")
  if "sync_colocated_s" in result:
    lines.append(f"  sync colocated (every device both sides): {_ms(result['sync_colocated_s'])} a step")
  else:
    lines.append(f"  sync colocated: does not fit ({result['sync_colocated_error']})")
  lines += [f"  best sync disaggregated: {bs['rollout_devices']} rollout / {bs['trainer_devices']} trainer,"
            f" {_ms(bs['sync_disaggregated_s'])} a step",
            f"  best async k={k}: {ba['rollout_devices']} rollout / {ba['trainer_devices']} trainer,"
            f" {_ms(ba[f'async_k{k}_s'])} a step (bounded mode's mean lag {ba['bounded_lag_mean']:.2f})",
            f"  predicted speedup of async: x{result['speedup_async_vs_sync_disaggregated']:.2f} vs sync"
            f" disaggregated (each at its best split; x{result['speedup_async_vs_sync_disaggregated_same_split']:.2f}"
            " at the async split)" + (f", x{result['speedup_async_vs_sync_colocated']:.2f} vs sync colocated"
                                      if "speedup_async_vs_sync_colocated" in result else "")]
  return "\n".join(lines)
