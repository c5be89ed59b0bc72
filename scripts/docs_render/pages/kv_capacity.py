from __future__ import annotations

from collections.abc import Callable

from ..common import Figure, _read_json


def kv_table(r: dict) -> str:
  """`opdjax kv-capacity --json` rows in the CLI's column layout, without its heading line."""
  res = r["result"]
  cols = ("weights", "kv", "weight GiB", "KV B/token", "KV blocks", "KV tokens", "ratio")
  rows = [[x["weights"], x["kv"], f"{x['weight_gib']:.3f}", str(x["kv_bytes_per_token"]), f"{x['kv_blocks']:,}",
           f"{x['kv_tokens']:,}" if x["fits"] else f"0 (needs {x['memory_needed_gib']:.2f} GiB)",
           "-" if x["kv_tokens_ratio"] is None else f"{x['kv_tokens_ratio']:.3f}x"] for x in res["rows"]]
  widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
  fmt = lambda row: "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
  return "\n".join(["```", *map(fmt, [list(cols), *rows]), "```"])


def kv_last(key: str, fmt: str) -> Callable[[dict], str]:
  """A number of the last row (recipe weights, FP8 KV), for prose."""
  return lambda r: fmt.format(r["result"]["rows"][-1][key])


def kv_fp8_weights(r: dict) -> str:
  """What FP8 weights add: the BF16 weights' share of the memory, what FP8 saves, the tokens it adds."""
  res = r["result"]
  row = {(x["weights"], x["kv"]): x for x in res["rows"]}
  bf16, fp8 = row["bf16", "bf16"], row["fp8", "bf16"]
  return (f"weights are {bf16['weight_gib'] / res['memory_gib']:.0%} of it, so FP8 weights"
          f" (−{bf16['weight_gib'] - fp8['weight_gib']:.2f} GiB) add"
          f" {fp8['kv_tokens'] / bf16['kv_tokens'] - 1:.0%} tokens")


def _kv(model: str, memory: float, layers: str, *extra: str) -> Figure:
  cmd = f"opdjax kv-capacity --model {model} --memory-gib {memory} --kv-bf16-layers {layers} {' '.join(extra)}"
  return Figure((cmd.strip() + " --json {out}/kv.json",), _read_json("kv.json"), {"table": kv_table,
                "last_gib": kv_last("weight_gib", "{:.3f} GiB"), "last_ratio": kv_last("kv_tokens_ratio", "{:.3f}x"),
                "fp8_weights": kv_fp8_weights})


FIGURES: dict[str, Figure] = {
    "kv_smollm2": _kv("fetch:smollm2-135m", 72, "0"),
    "kv_qwen3_1p7b": _kv("qwen3-1.7b", 72, "27"),
    "kv_qwen3_1p7b_block": _kv("qwen3-1.7b", 72, "27", "--recipe fp8_block --keep-edge-layers 1"),
    "kv_qwen3_8b_72": _kv("qwen3-8b", 72, "0,35"),
    "kv_qwen3_8b_21": _kv("qwen3-8b", 21.6, "0,35"),
}
