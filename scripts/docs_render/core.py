"""The machinery of scripts/docs.py: result files (written and signed by `--refresh`, verified by `--check`),
the marker blocks of the pages, the PNGs drawn from result files, and the check that ties them together."""

from __future__ import annotations

import datetime
import glob
import hashlib
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
from dataclasses import dataclass

from opdjax.analyses import reporting

from . import numbers, verdict_check
from .common import ROOT, DocsError, collect_run, provenance
from .registry import FIGURES

MARK = re.compile(r"<!-- (/?)docs\.py:([\w.-]+) -->")
TOKEN = re.compile(r"[^\s|*`(),;]+")
META = ("command", "commit", "machine", "date", "measured")


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
  verify_digest(r, os.path.relpath(path, root))
  return r


FRESH, RECORDED = "fresh run", "run by `docs.py --record` on "  # --refresh NAME; --refresh NAME --from DIR (+ date)


def measured(r: dict) -> bool:
  return r.get("measured") == FRESH or str(r.get("measured")).startswith(RECORDED)  # a command wrote it


def verify_digest(r: dict, where: str) -> None:
  """Every result file carries a `digest`, written with it by the command's writer (`docs.py --refresh`, through
  `reporting.record_digest`, the one helper that makes one), and must still match it: a field changed
  afterwards, or a file no command signed, is refused. The result inside (e.g. a reproduction.json, which
  scripts/reproduce.py signs itself) is checked the same way when it carries its own."""
  if "digest" not in r or not measured(r):
    raise DocsError(f"{where} carries no digest, so a hand edit would pass: re-run its command with"
                    " `python scripts/docs.py --refresh NAME` (its writer signs it), or move the figure to"
                    " docs/history.md")
  for rec, what in ((r, where), (r.get("result"), f"{where}'s result")):
    if isinstance(rec, dict) and "digest" in rec and rec["digest"] != reporting.record_digest(rec):
      raise DocsError(f"{what} was changed after its command wrote it (digest mismatch): re-run it with"
                      " `python scripts/docs.py --refresh NAME` instead of editing the file")


def _git(root: str, *args: str) -> str:
  return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()


def cpu_type() -> str:
  """The CPU as XLA compiles for it: model name, x86 family and model (a Zen 4 and a Zen 5 EPYC share the name),
  widest vector ISA. XLA's CPU kernels target the host, so a long run rounds differently on another type."""
  info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
  cpu = re.search(r"model name\s*:\s*(.*)", info)
  family, model = re.search(r"cpu family\s*:\s*(\d+)", info), re.search(r"^model\s*:\s*(\d+)", info, re.M)
  flags = re.search(r"flags\s*:\s*(.*)", info)
  flags = set(flags.group(1).split()) if flags else set()
  isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
  gen = f" (x86 family {family.group(1)} model {model.group(1)})" if family and model else ""
  return f"{cpu.group(1) if cpu else platform.processor()}{gen}, {isa}"


def machine() -> str:
  """The machine a command ran on: its CPU, and its GPU where it has one (nvidia-smi's name and count)."""
  gpu = ""
  try:
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20).stdout.split("\n")
    names = [n.strip() for n in names if n.strip()]
    gpu = f"{len(names)}x {names[0]}, " if names else ""
  except (OSError, subprocess.SubprocessError):
    pass
  return (f"{gpu}{cpu_type()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()},"
          f" jax {importlib.metadata.version('jax')}")


def load_text(start: float) -> str:
  return f"load average {start:.1f} at start, {os.getloadavg()[0]:.1f} at end, on {os.cpu_count()} cores"


RECORD = "opdjax_record.json"  # what `record` writes beside a command's output: its signed provenance


def _files(run: str) -> dict[str, str]:
  paths = sorted(os.path.join(r, f) for r, _, fs in os.walk(run) for f in fs)
  return {os.path.relpath(p, run): hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths
          if os.path.relpath(p, run) != RECORD}


def record(root: str, name: str, run: str) -> dict:
  """Runs NAME's commands with {out} = `run` (a new folder) and writes RECORD there: the commands, commit,
  worktree, machine, date, load and wall time, a sha256 of every file the commands wrote, and a digest over
  it all. `--refresh NAME --from run` accepts that folder, on any machine (the lent GPU), and nothing else."""
  fig = FIGURES[name]
  if os.path.exists(run) and os.listdir(run):
    raise DocsError(f"{run} is not empty; give a new folder for NAME's output.")
  load0, t0 = os.getloadavg()[0], time.time()
  commit = _git(root, "rev-parse", "--short", "HEAD")  # what the command ran, read before it runs
  dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
  os.makedirs(run, exist_ok=True)
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
  rec = {"name": name, "command": [c.replace("{out}", "DIR") for c in fig.commands], "commit": commit,
         "worktree": f"{len(dirty.splitlines())} tracked files modified" if dirty else "clean", "machine": machine(),
         "date": datetime.date.today().isoformat(), "load": load_text(load0), "wall_s": round(time.time() - t0, 1),
         "files": _files(run)}
  rec["digest"] = reporting.record_digest(rec)
  reporting.write_json(os.path.join(run, RECORD), rec)
  return rec


def _signed_record(name: str, run: str) -> dict:
  """The RECORD of folder `run`, refused (one line) unless `record` wrote it for NAME and no file changed since."""
  fig = FIGURES[name]
  path = os.path.join(run, RECORD)
  try:
    with open(path) as f:
      rec = json.load(f)
  except (OSError, json.JSONDecodeError):
    raise DocsError(f"--from {run}: no signed record ({RECORD}) there; only a folder that `python scripts/docs.py"
                    f" --record {name} --into DIR` wrote can be signed (run that, on the machine that measures).")\
        from None
  body = {k: v for k, v in rec.items() if k != "digest"}
  if rec.get("digest") != reporting.record_digest(body):
    raise DocsError(f"--from {run}: {RECORD} was edited after it was written (its digest differs); re-run the"
                    " command with --record.")
  if rec.get("name") != name or rec.get("command") != [c.replace("{out}", "DIR") for c in fig.commands]:
    raise DocsError(f"--from {run}: the record is of {rec.get('name')!r} ({rec.get('command')}), not of {name}'s"
                    " command; record NAME's own command.")
  changed = sorted(k for k, v in _files(run).items() if rec["files"].get(k) != v) + \
      sorted(k for k in rec["files"] if not os.path.exists(os.path.join(run, k)))
  if changed:
    raise DocsError(f"--from {run}: {', '.join(changed[:3])} changed after the command wrote the folder; re-run it.")
  return rec


def refresh(root: str, name: str, from_dir: str | None = None) -> dict:
  fig = FIGURES[name]
  if from_dir:  # a run made elsewhere: its own signed record's provenance, nothing invented here
    rec = _signed_record(name, from_dir)
    run = from_dir
  else:
    run = os.path.join(tempfile.mkdtemp(prefix=f"docs-{name}-"), "run")
    rec = record(root, name, run)
  result = fig.collect(run)
  r = {"command": rec["command"], "commit": rec["commit"], "worktree": rec["worktree"], "machine": rec["machine"],
       "date": rec["date"], "measured": FRESH if not from_dir else f"{RECORDED}{rec['date']}",
       "load": rec["load"], **({"note": fig.note} if fig.note else {}), "wall_s": rec["wall_s"], "result": result}
  r["digest"] = reporting.record_digest(r)
  reporting.write_json(result_path(root, name), r)
  draw(root, name, r)
  return r


# ---------------------------------------------------------------- PNGs drawn from result files
PNG_KEY = "opdjax-result-digest"  # the PNG's text chunk: the digest of the result it was drawn from
PIXEL_TOLERANCE = 8  # of 255, a channel: antialiasing may move; a changed curve moves far more


def draw(root: str, name: str, r: dict, into: str | None = None) -> list[str]:
  """Draw NAME's PNGs from its result (into `into` instead of the repository when given), each stamped
  with the digest of the result it was drawn from."""
  from PIL import Image, PngImagePlugin

  paths = []
  for path, plot in FIGURES[name].images:
    out = os.path.join(into or root, path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    plot(r["result"], out)
    info = PngImagePlugin.PngInfo()  # only this chunk: the same pixels give the same bytes
    info.add_text(PNG_KEY, reporting.record_digest({"result": r["result"]}))
    Image.open(out).save(out, pnginfo=info)
    paths.append(out)
  return paths


_REDRAWN: dict[tuple[str, str], list] = {}  # (figure, its result's digest): the re-drawn PNGs' pixels


def _redrawn(root: str, name: str, r: dict, digest: str) -> list:
  """NAME's PNGs re-drawn from its result `r` (whose digest is `digest`), as pixel arrays: drawn once a process
  per result (a plot is a function of its result: a second --check in one process, as in the tests, reuses it)."""
  import numpy as np
  from PIL import Image

  if (name, digest) not in _REDRAWN:
    with tempfile.TemporaryDirectory() as tmp:
      _REDRAWN[name, digest] = [np.asarray(Image.open(p).convert("RGBA"), dtype=np.int16)
                                for p in draw(root, name, r, into=tmp)]
  return _REDRAWN[name, digest]


def check_pngs(root: str) -> list[str]:
  """Every docs/figures/*.png is drawn by a Figure from its result file and equals a re-drawing of it
  (the digest of the data it says it was drawn from, then its pixels)."""
  import numpy as np
  from PIL import Image

  owner = {path: name for name, fig in FIGURES.items() for path, _ in fig.images}
  pngs = sorted({*glob.glob("docs/figures/*.png", root_dir=root), *owner})
  errors = []
  for path in pngs:
    full = os.path.join(root, path)
    name = owner.get(path)
    if not name:
      errors.append(f"{path}: no result file draws it: add it to a Figure's images (scripts/docs_render/pages/)")
      continue
    if not os.path.isfile(full):
      errors.append(f"{path}: missing; `python scripts/docs.py --render` draws it from docs/results/{name}.json")
      continue
    r = load_result(root, name)
    want = reporting.record_digest({"result": r["result"]})
    if Image.open(full).text.get(PNG_KEY) != want:
      errors.append(f"{path}: not drawn from docs/results/{name}.json as it is now (its {PNG_KEY} differs):"
                    " `python scripts/docs.py --render` redraws it")
      continue
    a = np.asarray(Image.open(full).convert("RGBA"), dtype=np.int16)
    b = _redrawn(root, name, r, want)[[p for p, _ in FIGURES[name].images].index(path)]
    if a.shape != b.shape or np.abs(a - b).max() > PIXEL_TOLERANCE:
      moved = "its size" if a.shape != b.shape else f"{(np.abs(a - b).max(-1) > PIXEL_TOLERANCE).sum()} pixels"
      errors.append(f"{path}: differs from a re-drawing from docs/results/{name}.json ({moved}):"
                    " `python scripts/docs.py --render` redraws it")
  return errors


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
  if fig not in FIGURES:
    raise DocsError(f"{path}:{line}: unknown figure docs.py:{name} (NAMEs: {', '.join(FIGURES)})")
  if view != "provenance" and view not in FIGURES[fig].views:
    raise DocsError(f"{path}:{line}: unknown figure docs.py:{name} ({fig}'s views:"
                    f" {', '.join([*FIGURES[fig].views, 'provenance'])})")
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


CODE_PATH = re.compile(r"`((?:opdjax|scripts|tests|configs|bench|launch|docs)/[\w./-]+\.\w+)`")


def check_code_paths(root: str) -> list[str]:
  """Every repository file the docs name in backticks (`opdjax/analyses/sensitivity.py`) exists: a module
  moved by a refactor leaves no stale pointer (three did: opdjax/admission.py and two more)."""
  here = ROOT  # a copied docs tree checks against this one
  errors = []
  for path in doc_files(root):
    for i, line in enumerate(open(os.path.join(root, path)), 1):
      for m in CODE_PATH.finditer(line):
        if not any(os.path.exists(os.path.join(r, m.group(1))) for r in (root, here)):
          errors.append(f"{path}:{i}: `{m.group(1)}` is not a file of the repository (moved? name where it is now)")
  return errors


def check(root: str, demo_run: str | None = None) -> list[str]:
  errors, cache = [], {}
  run = {"result": collect_run(demo_run)} if demo_run else None
  recorded_on = load_result(root, "demo")["machine"] if run else ""
  if run and not recorded_on.startswith(cpu_type() + ","):
    # The line is compared where it can be reproduced bit for bit: on the CPU type it was recorded on. Said,
    # never silent; the run still had to pass scripts/check_demo.py's bar.
    print(f"docs.py: the demo run {demo_run} ran on {cpu_type()}; the README's demo line was recorded on"
          f" {recorded_on}. XLA's CPU kernels round differently per CPU type, so the"
          " line is compared only on the type it was recorded on (record this one: docs.py --refresh demo)",
          file=sys.stderr)
    run = None
  for path in doc_files(root):
    text = open(os.path.join(root, path)).read()
    for b in blocks(text, path):
      fig, view = split_name(b.name, path, b.line)
      cache[fig] = cache.get(fig) or load_result(root, fig)
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
  rendered = {b.name.partition(".")[0] for p in doc_files(root) for b in blocks(open(os.path.join(root, p)).read(), p)}
  if run and "demo" not in rendered:
    errors.append("README.md: no docs.py:demo.line block to compare the demo run with")
  errors += [f"docs/results/{n}.json: no page renders it (render it, or move it to docs/history.md and delete it)"
             for n in sorted(os.path.basename(f)[:-5] for f in glob.glob(result_path(root, "*")))
             if n not in rendered]
  errors += numbers.check(root, doc_files(root)) + check_code_paths(root) + verdict_check.check(root)
  return errors + check_pngs(root)


def render_all(root: str) -> list[str]:
  changed, cache = [], {}
  for path in doc_files(root):
    full = os.path.join(root, path)
    text = open(full).read()
    pieces, pos = [], 0
    for b in blocks(text, path):
      fig, _ = split_name(b.name, path, b.line)
      cache[fig] = cache.get(fig) or load_result(root, fig)
      want, body = render(b.name, cache[fig]), text[b.start:b.end]
      pieces += [text[pos:b.start], f"\n{want}\n" if body.startswith("\n") and body.endswith("\n") else want]
      pos = b.end
    if "".join(pieces) + text[pos:] != text:
      reporting.write_text(full, "".join(pieces) + text[pos:])
      changed.append(path)
  for name, fig in FIGURES.items():  # the PNGs, each from its result file
    if fig.images and os.path.isfile(result_path(root, name)):
      before = {p: open(os.path.join(root, p), "rb").read() for p, _ in fig.images
                if os.path.isfile(os.path.join(root, p))}
      changed += [os.path.relpath(p, root) for p in draw(root, name, load_result(root, name))
                  if open(p, "rb").read() != before.get(os.path.relpath(p, root))]
  return changed
