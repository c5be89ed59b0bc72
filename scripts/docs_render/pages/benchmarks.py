from __future__ import annotations

import json
import os

from ..common import DocsError, Figure, _bench_module, _read_json, markdown_table


def gpu_suite_section(r: dict) -> str:
  """bench/gpu_suite.py's own section (its lines and target table), from the JSON the run wrote."""
  return _bench_module("gpu_suite").markdown(r["result"], title=False).strip("\n")


def gpu_decode_floor(r: dict) -> str:
  """The engine's decode step against the bytes it must read each step (every weight once, the KV cache's mean
  fill), at the copy bandwidth measured on the lent H200 (bench/decode_profile.py's floor): how far the step is
  from memory-bound."""
  x, dp, suite = r["result"], _bench_module("decode_profile"), _bench_module("gpu_suite")
  spec = suite.ROLLOUT  # the engine part's shapes; the run's record must name the same
  if suite.rollout.shapes_line(spec) != x["rollout"]["shapes"]:
    raise DocsError("gpu_suite.json's rollout shapes are not bench/gpu_suite.py's ROLLOUT any more: compute its"
                    f" floor from the shapes it ran ({x['rollout']['shapes']})")
  weights_gb, kv_gb = dp.weight_bytes(spec) / 1e9, dp.kv_bytes(spec, spec["batch"]) / 1e9
  bw, new = dp.HBM_COPY_TB_S, spec["new"]
  floor_ms, step_ms = (weights_gb + kv_gb) / bw, 1e3 * x["rollout"]["opdjax"]["call_s"] / new
  fp8_saving = weights_gb / 2 / bw
  return (f"{step_ms:.2f} ms a decode step (a call over its {new} new tokens, prefill included), against a"
          f" memory floor of {floor_ms:.2f} ms: {weights_gb:.2f} GB of bf16 weights ({dp.param_count(spec) / 1e6:.0f}M"
          f" parameters) and on average {kv_gb:.2f} GB of KV cache ({spec['batch']} rows, {spec['prompt']} + {new}/2"
          f" positions) read once at {bw} TB/s, {step_ms / floor_ms:.1f}x off it. FP8 weights save at most"
          f" {fp8_saving:.2f} ms of that step ({fp8_saving / step_ms:.0%}); the measured W8A8 engine ran at"
          f" {x['engine_decode']['fp8_w8a8_speedup']:.2f}x bf16")


def collect_decode_profile(out: str) -> dict:
  """bench/decode_profile.py's JSON, its trace's kernels summed again from the trace it wrote (a run before the
  bench summed them by kind has its kinds too)."""
  rep = json.load(open(os.path.join(out, "decode_profile.json")))
  trace = os.path.join(out, "decode_profile_trace.json.gz")
  if os.path.isfile(trace):
    ops = _bench_module("decode_profile").device_ops(trace)
    ops.pop("file", None)
    rep["profile"].update(ops)
  return rep


def decode_profile_table(r: dict) -> str:
  rows = [[str(w["batch"]), f"{w['sampled']['decode_step_ms']:.2f}", f"{w['greedy']['decode_step_ms']:.2f}",
           f"{w['floor_ms']:.2f}", f"{w['sampled']['x_floor']:.1f}x", f"{w['new_tokens_per_s']:,}"]
          for w in r["result"]["rows"]]
  head = ["batch", "decode step, sampled (ms)", "greedy (ms)", "memory floor (ms)", "step / floor",
          "new tokens/s (sampled call)"]
  return markdown_table(head, rows)


def _kernels_a_step(profile: dict) -> float:
  """The traced call's kernels over its forward passes (the prefill and one a new token)."""
  return profile["kernels"] / (profile["new_tokens"] + 1)


def decode_profile_kernels(r: dict) -> str:
  p = r["result"]["profile"]
  total = p["total_ms"]
  share = ", ".join(f"{g} {ms / total:.0%}" for g, ms in p["groups_ms"].items())
  return (f"{total:.1f} ms of GPU kernels for a call of {p['new_tokens']} new tokens at batch {p['batch']}"
          f" ({p['kernels']:,} kernels, about {_kernels_a_step(p):.0f} a step): {share}")


def collect_decode_layers(out: str) -> dict:
  """Two bench/decode_profile.py runs of one device call, OUT/scan and OUT/unrolled (`--unroll-layers`)."""
  return {v: collect_decode_profile(os.path.join(out, v)) for v in ("scan", "unrolled")}


def decode_layers_table(r: dict) -> str:
  traced = r["result"]["scan"]["profile"]["new_tokens"]
  head = ["decoder layers", "decode step, sampled (ms)", "greedy (ms)", "step / floor", "kernels a step",
          *(f"{k} in the traced call of {traced} tokens (ms)" for k in ("copies", "matmuls", "other")),
          "the run's wall (s)"]
  rows = []
  for v, label in (("scan", "one scan (as shipped)"), ("unrolled", "unrolled (`--unroll-layers`)")):
    x = r["result"][v]
    w, p = x["rows"][0], x["profile"]
    g = p["groups_ms"]
    rows.append([label, f"{w['sampled']['decode_step_ms']:.2f}", f"{w['greedy']['decode_step_ms']:.2f}",
                 f"{w['sampled']['x_floor']:.1f}x", f"{_kernels_a_step(p):.0f}",
                 f"{g['copies']:.1f}", f"{g['matmuls']:.1f}", f"{g['other']:.1f}", f"{x['wall_s']:.0f}"])
  return markdown_table(head, rows)


def engine_versions_setup(r: dict) -> str:
  return "\n".join(_bench_module("engine_versions").setup_lines(r["result"]))


def engine_versions_table(r: dict) -> str:
  """The bench's own tables and verdict lines (its module renders them for its printout too)."""
  ev = _bench_module("engine_versions")
  return "\n".join([ev.markdown(r["result"]), "", *ev.summary_lines(r["result"])])


def served_teacher_table(r: dict) -> str:
  """bench/served_teacher.py: per workload, the teacher in the trainer vs served (medians over ABAB rounds)."""
  res = r["result"]
  mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
  head = ["workload", "s/step in trainer", "s/step served", "step_time_ratio", "trainer MiB in trainer",
          "trainer MiB served", "trainer_memory_ratio", "teacher params MiB", "peak RSS ratio", "server peak RSS MiB",
          "steps timed", "load"]
  rows = []
  for name, w in res["workloads"].items():
    loads = [x for run in w["runs"] for x in run["load"]]
    noise = " (noise)" if w["step_time_noise"] else ""
    rows.append([name, f"{w['step_s']['trainer']:.3f}", f"{w['step_s']['vllm']:.3f}",
                 f"**{w['step_time_ratio']:.2f}**{noise}", mib(w["trainer_bytes"]["trainer"]),
                 mib(w["trainer_bytes"]["vllm"]), f"**{w['trainer_memory_ratio']:.3f}**",
                 mib(w["teacher_param_bytes"]), f"{w['trainer_rss_ratio']:.3f}", f"{w['server_peak_rss'] / 2**20:.0f}",
                 f"{w['steps_timed']['trainer']} + {w['steps_timed']['vllm']}", f"{min(loads):.1f}-{max(loads):.1f}"])
  la = res["load_average"]
  under = (f"Measured under load (1-minute load average {la['runs_min_max'][0]:.1f}-{la['runs_min_max'][1]:.1f} on"
           f" {la['cores']} cores, other jobs running): the step times are not this box's speed, and a ratio marked"
           " (noise) is within the spread of the trainer side's own rounds (of its steps, with one round)."
           if res["measured_under_load"] else
           f"Load average {la['runs_min_max'][0]:.1f}-{la['runs_min_max'][1]:.1f} on {la['cores']} cores.")
  return "\n".join([markdown_table(head, rows), "", under])


def weight_sync_table(r: dict) -> str:
  """bench/weight_sync.py: per model, today's path and the shard-wise one with its reload probe (medians),
  then where the time goes."""
  res, gb = r["result"], 1e9
  rows = []
  for m in res["models"]:
    for side in ("today", "new"):
      nb, exp, rel = m[f"{side}_bytes"], m[f"{side}_export_s"], m[f"{side}_reload_s"]
      probe = m["probe_s"] if side == "new" else 0.0
      total = exp + rel + probe
      rows.append([m["name"], "fp32 save_hf_params" if side == "today" else "bf16 shard-wise + probe",
                   f"{nb / gb:.3f}", f"{exp:.3f}", f"{nb / exp / gb:.2f}", f"{rel:.3f}" if m["server"] else "-",
                   f"{probe:.3f}" if side == "new" else "-", f"{total:.3f}",
                   f"**{m['today_s'] / total:.2f}x**" if side == "new" else "1"])
  head = ["model", "path", "GB", "export s", "export GB/s", "reload s", "probe s", "update s", "speedup"]
  s, la = res["models"][0], res["load_average"]
  notes = [f"- memory copy {res['copy_gbps']:.2f} GB/s, write into /dev/shm {res['shm_write_gbps']:.2f} GB/s (same run,"
           " best of 5, 512 MiB): an export's physical limits on one host.",
           f"- {s['name']}: the probe costs {s['probe_s']:.3f} s of the update (median): the trainer's score,"
           " dispatched with the export, runs while the server reloads and is read after it, then every server"
           f" answers. Alone after the update: the trainer's score {s['probe_trainer_s']:.3f} s, the server's answer"
           f" {s['probe_server_s']:.3f} s; max |server - trainer| over the runs {s['probe_max_abs']:.3f} (bf16"
           " server).",
           f"- {s['name']}, reload split: pause + resume {s['today_control_s']:.3f} / {s['new_control_s']:.3f} s,"
           f" the reload RPC and prefix-cache reset {s['today_rpc_s']:.3f} s (fp32 file) / {s['new_rpc_s']:.3f} s"
           " (bf16 file).",
           *(f"- {m['name']}, new export split: re-layout (cast, transpose, all-to-all) {m['new_relayout_s']:.3f} s,"
             f" write {m['new_write_s']:.3f} s." for m in res["models"]),
           f"- load average {la['start'][0]:.1f} at the start, {la['end'][0]:.1f} at the end ({la['cores']} cores);"
           f" median of {res['reps']} updates a path after a warm-up.", *(f"- {x}" for x in res["skipped"])]
  return "\n".join([markdown_table(head, rows), "", *notes])


def _qwen_export(res: dict) -> str:
  """The Qwen3-shaped model's export speedup, with the trainer's probe score when it ran export only."""
  q, qp = res.get("qwen_export_speedup"), res.get("qwen_export_speedup_with_probe")
  if not q:
    return ""
  return f"{qp:.2f}x with the trainer's probe score ({q:.2f}x without it)" if qp else f"{q:.2f}x"


def weight_sync_headline(r: dict) -> str:
  res = r["result"]
  q = _qwen_export(res)
  return (f"SmolLM2 update with its reload probe, today's path / shard-wise bf16: **{res['speedup_with_probe']:.2f}x**"
          f" (probe {res['probe_s']:.3f} s; {res['speedup']:.2f}x without it)"
          + (f"; Qwen3-1.7B-shaped export: {q}" if q else ""))


def weight_sync_line(r: dict) -> str:
  """The README's sentence."""
  res = r["result"]
  q = _qwen_export(res)
  return (f"a SmolLM2 update with its reload probe {res['speedup_with_probe']:.2f}x the speed of the fp32 whole-model"
          f" path (probe {res['probe_s']:.2f} s, {res['speedup']:.2f}x without it; vLLM's own reload,"
          f" {res['models'][0]['new_reload_s']:.2f} s, does not shrink)"
          + (f", the export of a Qwen3-1.7B-shaped model {q}" if q else ""))


FIGURES: dict[str, Figure] = {
    "decode_profile": Figure(("PYTHONPATH=. python bench/decode_profile.py --mode gpu",), collect_decode_profile,
                             {"table": decode_profile_table, "kernels": decode_profile_kernels},
                             note="run on the lent H200 through the session's device tool (python3, the image's"
                                  " CUDA jax), from commit d2e29b2's tree with bench/decode_profile.py added (its"
                                  " measuring code as committed in 3d479b9); the folder it wrote read with --refresh"
                                  " decode_profile --from at the commit below, which sums the trace's kernels"),
    "decode_profile_layers": Figure(
        ("PYTHONPATH=. OUT=DIR/scan python bench/decode_profile.py --mode gpu --batch-factors 1",
         "PYTHONPATH=. OUT=DIR/unrolled python bench/decode_profile.py --mode gpu --batch-factors 1 --unroll-layers"),
        collect_decode_layers, {"table": decode_layers_table},
        note="one call on the lent H200 (python3, the image's CUDA jax), from commit 4d3a605's tree with"
             " --batch-factors and --unroll-layers added; the folder read with --refresh decode_profile_layers --from"
             " at the commit below, which sums each trace's kernels"),
    "engine_versions": Figure(("python bench/engine_versions.py --before 5daaaa2 --out {out}/engine_versions.json",),
                              _read_json("engine_versions.json"),
                              {"setup": engine_versions_setup, "table": engine_versions_table},
                              env={"PYTHONPATH": "."},
                              note="5daaaa2: the commit before e03a96c, which brought the per-layer KV cache and"
                                   " weights prepared once per version"),
    "gpu_suite": Figure(("bash bench/gpu_suite.sh --budget 540",), _read_json("gpu_suite.json"),
                        {"section": gpu_suite_section, "decode_floor": gpu_decode_floor},
                        note="run on the lent H200 through the session's device tool (PYTHON=python3, the image's"
                             " CUDA jax and torch), from commit bd689b6's tree with the --budget flag that d2e29b2"
                             " committed; the folder it wrote read with --refresh gpu_suite --from at the commit"
                             " below"),
    "weight_sync": Figure(("python bench/weight_sync.py --out {out}/weight_sync.json",), _read_json("weight_sync.json"),
                          {"table": weight_sync_table, "headline": weight_sync_headline, "line": weight_sync_line},
                          env={"PYTHONPATH": "."}),
    "served_teacher": Figure(("python bench/served_teacher.py --out {out}/served_teacher.json",),
                             _read_json("served_teacher.json"), {"table": served_teacher_table},
                             env={"PYTHONPATH": "."}),
}
