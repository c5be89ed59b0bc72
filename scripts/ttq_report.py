"""scripts/time_to_quality.py's result rendered: the headline against the fastest synchronous configuration with
the ratios that take it apart, and one row a configuration. time_to_quality.py prints them; BENCHMARKS.md and
docs/async.md render them from the signed result file (scripts/docs.py)."""

from __future__ import annotations

from opdjax.analyses import reporting


def _seeds(vals, fmt="{:.1f}") -> str:
  return ", ".join("-" if v is None else fmt.format(v) for v in vals)


def _h(res: dict) -> dict:
  h = res.get("speedup_async_k1_vs_best_sync")
  if not h or h.get("median") is None:
    raise ValueError("the result has no speedup_async_k1_vs_best_sync (every seed flagged, or no async k=1 run)")
  return h


def headline(res: dict) -> str:
  """The lead sentence: async k=1 against the fastest synchronous configuration, per seed, with the
  machine's bound, the load, and the trainer's step against its synchronous one."""
  h = _h(res)
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
          f" ({len(h['excluded_seeds'])} seeds).")


def table(res: dict) -> str:
  """Per configuration: its layout, seconds to the reverse-KL target (the headline's) and to accuracy, for
  all steps, each side's CPU use, the trainer-step ratio, load."""
  rows = []
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
  return reporting.markdown_table(rows, head)


def summary(res: dict) -> str:
  """The headline paragraph, then the ratios that take it apart (overlap alone, moving the teacher alone), to the
  reverse-KL target (median over seeds, per seed) and at equal steps."""
  h = _h(res)

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
  return "\n".join([headline(res), "", *out, *rows])
