"""What every page's figures share: the registry's types, the readers of a command's output (a run's
metrics.jsonl, a JSON it wrote) and the views that call a command's own renderer (`bench`, `script`)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DocsError(Exception):
  pass


@dataclass(frozen=True)
class Figure:
  commands: tuple[str, ...]            # shell lines; {out}: a fresh folder the result is collected from
  collect: Callable[[str], dict]       # the command's output folder -> the result the file keeps
  views: dict[str, Callable[[dict], str]]  # VIEW -> the text of <!-- docs.py:NAME.VIEW --> from the result file
  run_views: tuple[str, ...] = ()      # views a `--demo-run` folder must reproduce (deterministic ones)
  env: dict[str, str] = field(default_factory=dict)
  note: str = ""                       # how the command ran, kept in the result file
  images: tuple = ()                   # (path, plot(result, path)): PNGs drawn from the result by --refresh
                                       # and --render, compared with a re-drawing by --check


def provenance(r: dict) -> str:
  """NAME.provenance, for every NAME: the command, date, commit, machine and load of its result file."""
  load = f"; {r['load']}" if r.get("load") else ""  # a timing says its load
  return f"`{' && '.join(r['command'])}` ({r['date']}, commit {r['commit']}; {r['machine']}{load})"


def _read_json(name: str) -> Callable[[str], dict]:
  return lambda out: json.load(open(os.path.join(out, name)))


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


def _stdout(run: str, i: int = 0) -> str:
  return open(os.path.join(os.path.dirname(run), f"stdout{i}.txt")).read()


def bench(module: str, fn: str) -> Callable[[dict], str]:
  """A view that is bench/MODULE.py's own renderer FN of the result (the one its printout uses)."""
  return lambda r: getattr(_bench_module(module), fn)(r["result"])


def module(name: str):
  """A module of scripts/ (on the path with docs.py), imported where a view or a drawing needs it (most import jax)."""
  return importlib.import_module(name)


def script(module: str, fn: str, key: str | None = None) -> Callable[[dict], str]:
  """A view that is scripts/MODULE.py's own renderer FN of the result (or of its part KEY)."""
  def view(r: dict) -> str:
    return getattr(importlib.import_module(module), fn)(r["result"][key] if key else r["result"])
  return view


def _bench_module(name: str):
  """A module of bench/ (no package: its modules import each other by name)."""
  bench = os.path.join(ROOT, "bench")
  sys.path.insert(0, bench)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(bench)
