from __future__ import annotations

import json
import os

from ..common import DocsError, Figure, _read_json, _seeds, markdown_table


def collect_ttq(run: str) -> dict:
  """scripts/time_to_quality.py's JSON as it wrote it: each run keeps its curve (`runs[*].curve`, a list of
  {step, wall_s, accuracy, reverse_kl}), which the PNG is drawn from."""
  return json.load(open(os.path.join(run, "time_to_quality.json")))


def plot_ttq(result: dict, path: str) -> str:
  """scripts/time_to_quality.py's own figure (imported here only: one drawing of the curves)."""
  before = os.environ.get("JAX_NUM_CPU_DEVICES")
  import time_to_quality  # sets JAX_NUM_CPU_DEVICES for its own runs: not for this process's children

  if before is None:
    os.environ.pop("JAX_NUM_CPU_DEVICES", None)
  return time_to_quality.plot(result["runs"], path)


def _h(r: dict) -> dict:
  h = r["result"].get("speedup_async_k1_vs_best_sync")
  if not h or h.get("median") is None:
    raise DocsError("the result has no speedup_async_k1_vs_best_sync (every seed flagged, or no async k=1 run)")
  return h


def ttq_headline(r: dict) -> str:
  """The lead sentence: async k=1 against the fastest synchronous configuration, per seed, with the
  machine's bound, the load, and the trainer's step against its synchronous one."""
  res, h = r["result"], _h(r)
  conf = res["configs"]
  runs = [x for x in res["runs"] if x["config"] in (h["against"], h["async"]) and x["seed"] in h["seeds"]]
  loads = [x["load_1min_median"] for x in runs]
  others = [x["other_cpu_per_wall"] for x in runs]
  b = h["physical_bound_seeds"]
  cpu = lambda k: sorted(x[k] for x in b)[len(b) // 2]  # noqa: E731
  wall = sorted(x["wall_s"] for x in b)[len(b) // 2]
  ratio = conf[h["async"]].get("trainer_step_ratio_vs_sync")
  eff = res.get(f"overlap_efficiency_{h['async']}")
  bound = f" ({h['bound']}: a run missed the target and counts with its whole run)" if h["bound"] else ""
  crossed = ("the curves' steep part, every run crosses it" if res["targets"].get("reverse_kl_crossed_by_every_run")
             else "NOT crossed by every run")
  return (f"async k=1 (`{h['async']}`) reaches held-out reverse KL {res['targets']['reverse_kl']:.3g}"
          f" ({crossed}; {res['num_eval']} held-out prompts)"
          f" **{h['median']:.2f}x** sooner than the fastest synchronous configuration (`{h['against']}`), median"
          f" of {len(h['per_seed'])} seeds, per seed {_seeds(h['per_seed'], '{:.2f}')} (range"
          f" {h['min']:.2f}-{h['max']:.2f}){bound}; {h['steps_ratio']:.2f}x at equal steps. The bound on this"
          f" machine: the synchronous run used {cpu('cpu_s_trainer_process'):.1f} + {cpu('cpu_s_engine_process'):.1f}"
          f" CPU s (trainer + engine process, median seed) in {wall:.1f} s on {res['cpu_count']} cores, so no"
          f" overlap of the same work can beat **{h['physical_bound']:.2f}x**."
          f" The asynchronous trainer's step is {'-' if ratio is None else f'{ratio:.2f}'}x its synchronous"
          f" step (overlap efficiency {'-' if eff is None else f'{eff:.2f}'}). Load: 1-minute"
          f" {min(loads):.1f}-{max(loads):.1f}, other processes {min(others):.2f}-{max(others):.2f} CPU s / wall s;"
          f" {len(res['flagged_runs'])} of {len(res['runs'])} runs flagged and left out"
          f" ({len(h['excluded_seeds'])} seeds)")


def ttq_best_table(r: dict) -> str:
  """Per configuration: its layout, seconds to the reverse-KL target (the headline's) and to accuracy, for
  all steps, each side's CPU use, the trainer-step ratio, load."""
  res, rows = r["result"], []
  tk, ta = res["targets"]["reverse_kl"], res["targets"]["accuracy"]
  for name in dict.fromkeys(x["config"] for x in res["runs"]):
    rs = [x for x in res["runs"] if x["config"] == name]
    c = res["configs"][name]
    med = lambda k, rs=rs: sorted(x[k] for x in rs)[len(rs) // 2]  # noqa: E731
    ratio = c.get("trainer_step_ratio_vs_sync")
    rows.append([name, f"{c['placement']}, teacher on {c['teacher_scoring']}",
                 _seeds(x["seconds_to_reverse_kl"] for x in rs),
                 f"{sum(x['seconds_to_accuracy'] is not None for x in rs)}/{len(rs)}",
                 _seeds(x["wall_s_at_equal_steps"] for x in rs), f"{med('final_reverse_kl'):.4f}",
                 f"{med('process_cpu_per_wall'):.2f} + {med('engine_process_cpu_per_wall'):.2f}",
                 "-" if ratio is None else f"{ratio:.2f}",
                 _seeds((x["load_1min_median"] for x in rs), "{:.1f}"),
                 str(sum(bool(x.get("flagged")) for x in rs))])
  head = ["configuration", "layout", f"s to reverse KL {tk:.3g} (seeds)", f"reached acc {ta}",
          f"s for {res['steps']} steps", "final reverse KL (median)", "CPU s / wall s: trainer + engine process",
          "trainer step / sync's", "load (median 1-min)", "flagged"]
  return markdown_table(head, rows)


def ttq_best_speedups(r: dict) -> str:
  """The headline and the ratios that take it apart (overlap alone, moving the teacher alone), to the
  reverse-KL target (median over seeds, per seed) and at equal steps."""
  res, h = r["result"], _h(r)

  def row(label, key):
    d = res.get(f"speedup_{key}_reverse_kl")
    if d is None:
      return None
    bound = f" ({d['bound']})" if d["bound"] else ""
    return (f"| {label} | {d['median']:.2f}{bound} | {_seeds(d['seeds'], '{:.2f}')} |"
            f" {res[f'steps_speedup_{key}']:.2f} |")

  rows = [f"| **async k=1 ({h['async']}) vs the fastest sync ({h['against']})** | **{h['median']:.2f}** |"
          f" {_seeds(h['per_seed'], '{:.2f}')} | {h['steps_ratio']:.2f} |",
          f"| physical bound over {h['against']} (this machine's cores, each side's CPU s) |"
          f" {h['physical_bound']:.2f} | {_seeds((b['bound'] for b in h['physical_bound_seeds']), '{:.2f}')} | |"]
  rows += list(filter(None, [
      row("overlap alone, colocated, teacher on the trainer (async_k1 vs sync_fp32)", "async_k1"),
      row("overlap alone, disaggregated, teacher on the trainer", "async_k1_vs_sync_disaggregated"),
      row("overlap alone, disaggregated, teacher on the engine", "async_k1_vs_sync_disaggregated_teacher_engine"),
      row("moving the teacher alone, sync disaggregated", "sync_teacher_engine_vs_sync_teacher_trainer_disaggregated"),
      row("moving the teacher alone, async k=1 disaggregated",
          "async_k1_teacher_engine_vs_async_k1_teacher_trainer_disaggregated"),
      row("sync disaggregated vs sync colocated (teacher on the trainer)", "sync_disaggregated_vs_sync_colocated"),
      row("sync disaggregated, teacher on the engine, vs sync colocated",
          "sync_disaggregated_teacher_engine_vs_sync_colocated")]))
  out = ["| ratio, to the reverse-KL target | median | per seed | at equal steps |", "| --- | --- | --- | --- |"]
  return "\n".join(out + rows)


def schedule_validation_table(r: dict) -> str:
  """scripts/validate_schedule.py: per layout, the step predicted from another run's costs against the
  measured one, beside the trivial predictor (the source run's measured step as it is)."""
  res = r["result"]
  pct = lambda x: f"{100 * x:+.0f}%"  # noqa: E731
  head = ["layout", "costs from", "predicted ms/step", "measured ms/step (repeats)", "error",
          "source's step as is", "overlap efficiency", "1-min load"]
  rows = []
  for x in res["rows"]:
    reps = ", ".join(f"{1e3 * v:.1f}" for v in x.get("measured_step_s_repeats", [x["measured_step_s"]]))
    rows.append([x["layout"], x["costs_from"], f"{1e3 * x['predicted_step_s']:.1f}",
                 f"{1e3 * x['measured_step_s']:.1f} ({reps})", f"**{pct(x['error'])}**", pct(x["baseline_error"]),
                 f"{x['overlap_efficiency']:.2f}", f"{min(x['load_1min']):.1f}-{max(x['load_1min']):.1f}"])
  beats = sum(abs(x["error"]) < abs(x["baseline_error"]) for x in res["rows"])
  worst = max(res["rows"], key=lambda x: abs(x["error"]))
  steps = res["steps"] if isinstance(res["steps"], dict) else {"jax": res["steps"]}
  summary = (f"{len(res['rows'])} layouts, {', '.join(f'{n} steps ({e} engine)' for e, n in steps.items())}"
             f" x {res.get('repeats', 1)} repeats each after"
             f" {res['warmup']} warm-up steps a depth ({res['config']}, {res['cpu_count']} cores); largest error"
             f" {pct(worst['error'])} ({worst['layout']}); the algebra beats the source's step as is in {beats} of"
             f" {len(res['rows'])}.")
  return "\n".join([markdown_table(head, rows), "", summary])


CORE_CASES = {"one_device": "one device", "serial": "devices 0 then 1", "two_threads": "two threads, devices 0 and 1",
              "one_pinned": "one process pinned to a core", "two_pinned": "two processes pinned apart"}


def core_split_table(r: dict) -> str:
  """bench/core_split.py: per case its wall and CPU seconds, the cores it held, its busiest threads."""
  res = r["result"]
  rows = [[label, f"{c['wall_s']:.2f}", f"{c['cpu_s']:.2f}", f"{c['cpu_per_wall']:.2f}",
           ", ".join(f"{b:g}" for b in c["busiest_threads_cpu_s"]) if "busiest_threads_cpu_s" in c
           else "(" + ", ".join(f"{side['cpu_s']:.2f}" for side in c["sides"]) + " a side)"]
          for case, label in CORE_CASES.items() if (c := res["cases"].get(case))]
  flags = "single-thread XLA flags" if res["flags"] else "XLA defaults"
  return markdown_table([f"case ({flags})", "wall s", "CPU s", "CPU s / wall s", "CPU s of the busiest threads"], rows)


def core_split_speedups(r: dict) -> str:
  res = r["result"]
  return (f"{res['parallel_speedup_two_threads']:.2f} for two threads and {res['parallel_speedup_two_pinned']:.2f}"
          f" for two pinned processes (2 = two cores)")


FIGURES: dict[str, Figure] = {
    "ttq_best": Figure(("python scripts/time_to_quality.py --out {out}",), collect_ttq,
                       {"headline": ttq_headline, "table": ttq_best_table, "speedups": ttq_best_speedups},
                       images=(("docs/figures/time_to_quality_best.png", plot_ttq),)),
    "schedule_validation": Figure(("python scripts/validate_schedule.py --engines jax,vllm --out {out}",),
                                  _read_json("schedule_validation.json"), {"table": schedule_validation_table}),
    "core_split": Figure(("python bench/core_split.py --json {out}/core_split.json",), _read_json("core_split.json"),
                         {"table": core_split_table, "speedups": core_split_speedups}, env={"PYTHONPATH": "."}),
}
