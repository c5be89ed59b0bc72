"""The modelled costs of `opdjax plan --schedule` (opdjax.analyses.schedule): per-stage seconds of a
teacher -> student OPD step on a layout of accelerators, from FLOPs and bytes.

FLOPs come from the model configs (every projection and the LM head, 2 a parameter and token
forward, 3x for forward and backward, one more forward with full remat, plus attention's QK^T and
AV over the average context): XLA's cost analysis of the compiled step counts a scanned layer
once, so it is not used. Generation: a prefill at a matmul efficiency, then a decode step per new
token bound by the larger of its reads (the engine's weights and the KV context of its rows, at a
bandwidth efficiency) and its FLOPs, on as many data-parallel engines as the smallest fitting
tensor parallelism leaves. The weight sync moves the engine's weights over the link between the
sides (disaggregated) or copies them within HBM (colocated). Memory is checked analytically per
device (fp32 student, grads and Adam, bf16 teacher, remat's layer inputs, a logits chunk; the
engine's weights and KV): `opdjax plan` compiles the trainer for an exact figure.

Not modelled: a colocated engine's switching costs (waking, resharding, KV cache re-allocation),
pipeline bubbles, stragglers, network contention; the efficiencies are assumptions (--efficiency).
"""

from __future__ import annotations

import dataclasses
import math

from opdjax.analyses.schedule import Costs, async_step, simulate, sync_step
from opdjax.errors import UserError

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
    "tpu-v5e": {"bf16_flops": 197e12, "fp8_flops": None, "hbm_bw": 819e9, "hbm_bytes": 16 * 2**30, "link_bw": 200e9,
                "source": "Google Cloud TPU v5e documentation (cloud.google.com/tpu/docs/v5e): 197 TFLOPS bf16,"
                          " 394 TOPS int8 (no fp8), HBM2 16 GiB at 819 GB/s, ICI 1,600 Gbps a chip"},
}
# Fractions of the peaks reached (assumptions, not measurements: override with --efficiency). Train:
# typical dense-LLM MFU at this scale; prefill: a large matmul batch; decode: weight and KV reads.
EFFICIENCY = {"train": 0.40, "prefill": 0.50, "decode_bw": 0.60}


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
  if lay.fp8:  # what FP8 changes is given, not predicted: the datasheet's peak and 1-byte weights and KV
    bf16 = dataclasses.replace(lay, fp8=False)
    r = best_async["rollout_devices"]
    speedup = generate_seconds(bf16, r) / generate_seconds(lay, r)
    out["inputs"] = {"fp8": {
        "fp8_flops": lay.spec["fp8_flops"], "bf16_flops": lay.spec["bf16_flops"], "weight_kv_bytes": 1,
        "generate_speedup_at_best_split": speedup,
        "source": lay.spec["source"] + "; 1-byte FP8 weights and KV cache (an assumption, not measured)",
        "text": f"FP8 generation x{speedup:.2f} faster at {r} rollout devices, from the datasheet's FP8 peak"
                f" ({lay.spec['fp8_flops'] / 1e12:,.1f} vs {lay.spec['bf16_flops'] / 1e12:,.1f} TFLOPS) and 1-byte"
                " weights and KV read (assumed); no FP8 run measured it (source: the device line above)"}}
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


