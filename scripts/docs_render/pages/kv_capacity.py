"""docs/kv_capacity.md's tables: `opdjax kv-capacity`'s own report (opdjax.analyses.capacity.report)."""

from __future__ import annotations

from opdjax.analyses import capacity

from ..common import Figure, _read_json


def fp8_weights(r: dict) -> str:
  """What FP8 weights add: the BF16 weights' share of the memory, what FP8 saves, the tokens it adds."""
  res = r["result"]
  row = {(x["weights"], x["kv"]): x for x in res["rows"]}
  bf16, fp8 = row["bf16", "bf16"], row["fp8", "bf16"]
  return (f"At {res['memory_gib']:g} GiB the model's BF16 weights are {bf16['weight_gib'] / res['memory_gib']:.0%} of"
          f" it, so FP8 weights (−{bf16['weight_gib'] - fp8['weight_gib']:.2f} GiB) add"
          f" {fp8['kv_tokens'] / bf16['kv_tokens'] - 1:.0%} tokens.")


def _kv(model: str, memory: float, layers: str, *extra: str) -> Figure:
  cmd = f"opdjax kv-capacity --model {model} --memory-gib {memory} --kv-bf16-layers {layers} {' '.join(extra)}"
  return Figure((cmd.strip() + " --json {out}/kv.json",), _read_json("kv.json"),
                {"table": lambda r: f"```\n{capacity.report(r['result'])}\n```", "fp8_weights": fp8_weights})


FIGURES: dict[str, Figure] = {
    "kv_smollm2": _kv("fetch:smollm2-135m", 72, "0"),
    "kv_qwen3_1p7b": _kv("qwen3-1.7b", 72, "27"),
    "kv_qwen3_1p7b_block": _kv("qwen3-1.7b", 72, "27", "--recipe fp8_block --keep-edge-layers 1"),
    "kv_qwen3_8b_72": _kv("qwen3-8b", 72, "0,35"),
    "kv_qwen3_8b_21": _kv("qwen3-8b", 21.6, "0,35"),
}
