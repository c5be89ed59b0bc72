from __future__ import annotations

from ..common import Figure, _read_json


def _splits(r: dict) -> dict:
  return {s["rollout_devices"]: s for s in r["result"]["splits"]}


def schedule_worked(r: dict) -> str:
  """README's worked example: the 4 / 12 split `opdjax plan --schedule` predicts, against the best and 8 / 8."""
  res = r["result"]
  split = _splits(r)
  chosen, best, half = split[4], res["best_async"], split[8]
  return (f"predicts at {chosen['async_k1_s']:.2f} s a step on H100s (predicted, not measured:"
          f" {chosen['sync_disaggregated_s']:.2f} s synchronous on the same split; the best split,"
          f" {best['rollout_devices']} / {best['trainer_devices']}, {best['async_k1_s']:.2f} s, splits no node evenly;"
          f" 8 / 8, a node of sidecars, {half['async_k1_s']:.2f} s)")


def schedule_step(r: dict) -> str:
  """The worked example's predicted async k=1 step (its 4 / 12 split), for another page."""
  return f"{_splits(r)[4]['async_k1_s']:.2f} s"


FIGURES: dict[str, Figure] = {
    "plan_schedule": Figure(("opdjax plan --schedule --teacher qwen3-8b --student qwen3-1.7b --devices 16 --batch 240"
                             " --prompt-len 512 --seq-len 1024 --fp8 --device h100-sxm --json {out}/schedule.json",),
                            _read_json("schedule.json"), {"worked": schedule_worked, "step": schedule_step}),
}
