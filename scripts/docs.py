"""Figures in README.md, BENCHMARKS.md and docs/*.md, rendered from the result files their commands wrote.

A figure lives between marker comments, inline or as a block of lines:

  held-out reverse KL <!-- docs.py:demo.line -->**8.086 -> 0.1181** ...<!-- /docs.py:demo.line -->

`demo` names a result file (docs/results/demo.json: the command, commit, machine, date and what it
measured) and `line` one of its renderers in FIGURES below; `NAME.provenance` works for every NAME.

  python scripts/docs.py --check                    # every block equals its rendering (CI)
  python scripts/docs.py --check --demo-run DIR     # ... and the README's demo line equals that run's
  python scripts/docs.py --refresh NAME [--from DIR]  # rerun NAME's command (or read DIR), rewrite
                                                       # its result file, its PNGs and the docs
  python scripts/docs.py --render                   # rewrite every block from the result files
  python scripts/docs.py --list                     # the registry

A figure that could not be re-measured keeps its numbers in a result file whose `measured` says
"as recorded at commit X": single-sourced and checked, and `--refresh` re-measures it.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the renderers reuse opdjax's own table code (no jax import)
from opdjax.analyses import prefix_shift_report, reporting  # noqa: E402

MARK = re.compile(r"<!-- (/?)docs\.py:([\w.-]+) -->")
TOKEN = re.compile(r"[^\s|*`(),;]+")
META = ("command", "commit", "machine", "date", "measured")


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
  recs = _metrics(out)
  first, last = recs[0], recs[-1]
  keep = ("reverse_kl", "accuracy")
  worst = {k: max(r[k] for r in recs if k in r) for k in ("mismatch_kl_k3_tok", "mismatch_abs_r_max")
           if any(k in r for r in recs)}
  loop_s = last.get("elapsed_s")
  return {"steps": last["step"], "first": {k: first[k] for k in keep if k in first},
          "last": {k: last[k] for k in keep if k in last}, "loop_s": loop_s,
          "s_per_step": loop_s / max(last["step"], 1) if loop_s else None, **({"max": worst} if worst else {})}


def _read_json(name: str) -> Callable[[str], dict]:
  return lambda out: json.load(open(os.path.join(out, name)))


def collect_tests(run: str) -> dict:
  counts = []
  for i in range(2):
    text = open(os.path.join(os.path.dirname(run), f"stdout{i}.txt")).read()
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
  return f"{r['result']['loop_s']:.0f} s ({r['load']})"


def step_time(r: dict) -> str:
  return f"about {r['result']['s_per_step']:.0f} s per step ({r['load']})"


def wall_time(r: dict) -> str:
  m, s = divmod(round(r["wall_s"]), 60)
  return f"{m} min {s} s" + (f" ({r['load']})" if r.get("load") else "")


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
  rows = [{"view": v, **{c: m[c] for c in MISMATCH_COLUMNS}} for v, m in r["result"]["views"].items()]
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


def provenance(r: dict) -> str:
  when = r["measured"] if r["measured"] != "fresh run" else f"{r['date']}, commit {r['commit']}"
  return f"`{' && '.join(r['command'])}` ({when}; {r['machine']})"


# ---------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Figure:
  commands: tuple[str, ...]            # shell lines; {out}: a fresh folder the result is collected from
  collect: Callable[[str], dict]
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
FIGURES: dict[str, Figure] = {
    "demo": Figure(("opdjax demo --out {out}",), collect_run,
                   {"line": demo_line, "time": loop_time}, run_views=("line",),
                   env={"OPDJAX_CACHE": "{out}/cache"}, note="OPDJAX_CACHE an empty folder: the demo models are"
                   " built first, as on a fresh clone and in CI"),
    "tests": Figure(("pytest --collect-only -q", 'pytest --collect-only -q -m "not slow"'), collect_tests,
                    {"count": tests_count}),
    "fast_tier_time": Figure(('pytest -m "not slow"',), lambda run: {}, {"time": wall_time}),
    "prefix_shift": Figure(("opdjax prefix-shift --out {out}",), _read_json("prefix_shift.json"),
                           {"head": prefix_shift_head, "table": prefix_shift_table},
                           images=(("docs/figures/prefix_shift_divergence.png", PSR.plot_divergence),
                                   ("docs/figures/prefix_shift_signal_error.png", PSR.plot_signal_error))),
    "mismatch": Figure(("opdjax mismatch --config configs/demo.py --out {out}",), _read_json("mismatch.json"),
                       {"table": mismatch_table, "attribution": mismatch_attribution}),
    "smollm2_jax": Figure((SMOLLM2 + " --config.train.steps=3",), collect_run, {"kl": run_kl, "time": step_time}),
    "smollm2_vllm": Figure((SMOLLM2 + " --config.train.steps=4 --config.rollout.engine=vllm",), collect_run,
                           {"kl": run_kl, "time": step_time, "mismatch": run_mismatch}),
    "kv_smollm2": _kv("fetch:smollm2-135m", 72, "0"),
    "kv_qwen3_1p7b": _kv("qwen3-1.7b", 72, "27"),
    "kv_qwen3_1p7b_block": _kv("qwen3-1.7b", 72, "27", "--recipe fp8_block --keep-edge-layers 1"),
    "kv_qwen3_8b_72": _kv("qwen3-8b", 72, "0,35"),
    "kv_qwen3_8b_21": _kv("qwen3-8b", 21.6, "0,35"),
}


# ---------------------------------------------------------------- result files
def result_path(root: str, name: str) -> str:
  return os.path.join(root, "docs", "results", f"{name}.json")


def load_result(root: str, name: str) -> dict:
  path = result_path(root, name)
  if not os.path.isfile(path):
    raise DocsError(f"{os.path.relpath(path, root)} does not exist: run `python scripts/docs.py --refresh {name}`")
  r = json.load(open(path))
  missing = [k for k in (*META, "result") if k not in r]
  if missing:
    raise DocsError(f"{os.path.relpath(path, root)}: missing {', '.join(missing)}")
  return r


def _git(root: str, *args: str) -> str:
  return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()


def machine() -> str:
  info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
  cpu = re.search(r"model name\s*:\s*(.*)", info)
  flags = re.search(r"flags\s*:\s*(.*)", info)
  flags = set(flags.group(1).split()) if flags else set()
  isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"  # XLA's CPU kernels differ
  return (f"{cpu.group(1) if cpu else platform.processor()}, {isa}, {os.cpu_count()} cores,"
          f" {platform.system()} {platform.machine()}, jax {importlib.metadata.version('jax')}")


def load_text(start: float) -> str:
  return f"load average {start:.1f} at start, {os.getloadavg()[0]:.1f} at end, on {os.cpu_count()} cores"


def refresh(root: str, name: str, from_dir: str | None = None) -> dict:
  fig = FIGURES[name]
  load0, t0 = os.getloadavg()[0], time.time()
  run = from_dir or os.path.join(tempfile.mkdtemp(prefix=f"docs-{name}-"), "run")
  if not from_dir:  # {out} is an empty folder; command i's stdout goes next to it (stdout{i}.txt)
    os.makedirs(run)
    for i, cmd in enumerate(fig.commands):
      line = cmd.format(out=run)
      env = {**os.environ, **{k: v.format(out=os.path.dirname(run)) for k, v in fig.env.items()}}
      print(f"docs.py: {line}", flush=True)
      proc = subprocess.run(shlex.split(line), cwd=root, env=env, stdout=subprocess.PIPE, text=True)
      log = os.path.join(os.path.dirname(run), f"stdout{i}.txt")
      with open(log, "w") as f:
        f.write(proc.stdout)
      if proc.returncode:
        raise DocsError(f"`{line}` exited {proc.returncode} (its output: {log})")
  dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
  r = {"command": [c.replace("{out}", "DIR") for c in fig.commands],
       "commit": _git(root, "rev-parse", "--short", "HEAD"),
       "worktree": f"{len(dirty.splitlines())} tracked files modified" if dirty else "clean",
       "machine": machine(), "date": datetime.date.today().isoformat(), "measured": "fresh run",
       "load": load_text(load0) if not from_dir else "load not recorded (read from an existing run folder)",
       **({"note": fig.note} if fig.note else {}), "wall_s": None if from_dir else round(time.time() - t0, 1),
       "result": fig.collect(run)}
  reporting.write_json(result_path(root, name), r)
  for path, plot in fig.images:  # not compared by --check (PNG bytes vary with matplotlib), redrawn here
    plot(r["result"], os.path.join(root, path))
  return r


# ---------------------------------------------------------------- blocks in the docs
@dataclass(frozen=True)
class Block:
  path: str      # relative to root
  name: str      # NAME.VIEW
  start: int     # offsets of the body in the text
  end: int
  line: int      # line of the opening marker


def doc_files(root: str) -> list[str]:
  return [p for p in ["README.md", "BENCHMARKS.md", *sorted(glob.glob("docs/*.md", root_dir=root))]
          if os.path.isfile(os.path.join(root, p))]


def blocks(text: str, path: str) -> list[Block]:
  found, open_ = [], None
  for m in MARK.finditer(text):
    line = text.count("\n", 0, m.start()) + 1
    if m.group(1) != "/":
      if open_:
        raise DocsError(f"{path}:{line}: docs.py:{m.group(2)} opens inside docs.py:{open_.group(2)}")
      open_ = m
    elif not open_ or open_.group(2) != m.group(2):
      raise DocsError(f"{path}:{line}: /docs.py:{m.group(2)} closes no open block")
    else:
      found.append(Block(path, m.group(2), open_.end(), m.start(), text.count("\n", 0, open_.end()) + 1))
      open_ = None
  if open_:
    raise DocsError(f"{path}:{text.count(chr(10), 0, open_.start()) + 1}: docs.py:{open_.group(2)} is never closed")
  return found


def split_name(name: str, path: str, line: int) -> tuple[str, str]:
  fig, _, view = name.partition(".")
  if fig not in FIGURES or (view != "provenance" and view not in FIGURES[fig].views):
    known = ", ".join(f"{f}.{v}" for f, x in FIGURES.items() for v in (*x.views, "provenance"))
    raise DocsError(f"{path}:{line}: unknown figure docs.py:{name} (known: {known})")
  return fig, view


def render(name: str, r: dict) -> str:
  fig, view = name.partition(".")[::2]
  return provenance(r) if view == "provenance" else FIGURES[fig].views[view](r)


def body_text(body: str) -> str:
  return body[1:-1] if body.startswith("\n") and body.endswith("\n") else body


def first_difference(found: str, want: str) -> tuple[int, str, str]:
  """(line offset, word in the doc, word rendered) of the first difference."""
  fl, wl = found.split("\n"), want.split("\n")
  for i in range(max(len(fl), len(wl))):
    a, b = (fl[i] if i < len(fl) else ""), (wl[i] if i < len(wl) else "")
    if a != b:
      ta, tb = TOKEN.findall(a), TOKEN.findall(b)
      j = next((k for k in range(max(len(ta), len(tb))) if ta[k:k + 1] != tb[k:k + 1]), 0)
      return i, (ta[j] if j < len(ta) else "<nothing>"), (tb[j] if j < len(tb) else "<nothing>")
  return 0, found, want


def check(root: str, demo_run: str | None = None) -> list[str]:
  errors, cache = [], {}
  run = {"result": collect_run(demo_run)} if demo_run else None
  for path in doc_files(root):
    text = open(os.path.join(root, path)).read()
    for b in blocks(text, path):
      fig, view = split_name(b.name, path, b.line)
      if fig not in cache:
        cache[fig] = load_result(root, fig)
      found, body = body_text(text[b.start:b.end]), text[b.start:b.end]
      first = b.line + (found != body)  # a block of lines starts on the line after its marker
      checks = [(cache[fig], os.path.relpath(result_path(root, fig), root))]
      if run and fig == "demo" and view in FIGURES["demo"].run_views:
        checks.append(({**cache[fig], **run}, f"the demo run {demo_run}"))
      for r, source in checks:
        want = render(b.name, r)
        if found != want:
          i, a, w = first_difference(found, want)
          errors.append(f"{path}:{first + i}: docs.py:{b.name} says {a!r} where {source} gives {w!r}")
  if run and not any(b.name.startswith("demo.") for p in doc_files(root)
                    for b in blocks(open(os.path.join(root, p)).read(), p)):
    errors.append("README.md: no docs.py:demo.line block to compare the demo run with")
  return errors


def render_all(root: str) -> list[str]:
  changed, cache = [], {}
  for path in doc_files(root):
    full = os.path.join(root, path)
    text = open(full).read()
    pieces, pos = [], 0
    for b in blocks(text, path):
      fig, _ = split_name(b.name, path, b.line)
      if fig not in cache:
        cache[fig] = load_result(root, fig)
      body = text[b.start:b.end]
      want = render(b.name, cache[fig])
      pieces += [text[pos:b.start], f"\n{want}\n" if body.startswith("\n") and body.endswith("\n") else want]
      pos = b.end
    new = "".join(pieces) + text[pos:]
    if new != text:
      reporting.write_text(full, new)
      changed.append(path)
  return changed


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  act = ap.add_mutually_exclusive_group(required=True)
  act.add_argument("--check", action="store_true", help="fail naming file, line and both values on a difference")
  act.add_argument("--refresh", metavar="NAME", help="rerun NAME's command, rewrite its result file and the docs")
  act.add_argument("--render", action="store_true", help="rewrite every block from the result files")
  act.add_argument("--list", action="store_true", help="print every NAME, its command and its result file")
  ap.add_argument("--demo-run", metavar="RUN", help="with --check: a demo run folder (or its metrics.jsonl)"
                  " whose numbers the README's demo line must equal")
  ap.add_argument("--from", dest="from_dir", metavar="DIR", help="with --refresh: read DIR, the output of"
                  " NAME's command run by hand, instead of running it")
  ap.add_argument("--root", default=ROOT, help="the repository to work on (default: this one)")
  args = ap.parse_args(argv)
  try:
    if args.list:
      for name, fig in FIGURES.items():
        print(f"{name}: {' && '.join(fig.commands)} -> docs/results/{name}.json (views: {', '.join(fig.views)})")
      return 0
    if args.refresh:
      if args.refresh not in FIGURES:
        raise DocsError(f"unknown NAME {args.refresh!r}; known: {', '.join(FIGURES)}")
      refresh(args.root, args.refresh, args.from_dir)
    if args.refresh or args.render:
      print(f"docs.py: rewrote {', '.join(render_all(args.root)) or 'nothing (all up to date)'}")
      return 0
    errors = check(args.root, args.demo_run)
  except DocsError as e:
    print(f"docs.py: {e}", file=sys.stderr)
    return 2
  for e in errors:
    print(e, file=sys.stderr)
  if errors:
    print(f"docs.py: {len(errors)} figure(s) differ from their result files; `python scripts/docs.py --render`"
          " rewrites them from the files, `--refresh NAME` re-measures", file=sys.stderr)
    return 1
  print("docs.py: every rendered figure equals its result file")
  return 0


if __name__ == "__main__":
  sys.exit(main())
