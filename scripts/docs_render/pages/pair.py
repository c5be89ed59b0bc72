"""README's "Distill your own pair" CPU recipe over seeds (scripts/pair_recipe.py) and docs/collapse.md."""

from __future__ import annotations

from ..common import Figure, _read_json, markdown_table

PAIR = ("python scripts/pair_recipe.py --out {out} --seeds 0,1,2,3,4 --set student.keep_layers=0:12,18:30"
        " --set optim.learning_rate=3e-5 --set optim.total_steps=0 --set train.steps=20 --set train.eval_every=5"
        " --set task.num_eval=16")
MEASURES = {"reverse_kl": ("held-out reverse KL, own samples", -1), "teacher_nll": ("NLL on the teacher's answers", -1),
            "teacher_f1": ("token F1 against the teacher", +1)}


def closer(r: dict) -> dict[str, bool]:
  """Per measure: its 95% interval of the change across seeds lies on the side of getting closer (derived here,
  from the intervals, not read from the file)."""
  ch = r["result"]["changes"]
  return {k: (ch[k]["high"] < 0 if d < 0 else ch[k]["low"] > 0) for k, (_, d) in MEASURES.items()}


def pair_table(r: dict) -> str:
  res, ok = r["result"], closer(r)
  rows = []
  for k, (label, _) in MEASURES.items():
    first = [run["curve"][0][k] for run in res["runs"].values()]
    last = [run["curve"][-1][k] for run in res["runs"].values()]
    c = res["changes"][k]
    rows.append([label, f"{sum(first) / len(first):.3f}", f"{sum(last) / len(last):.3f}",
                 f"{c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]", "closer" if ok[k] else "not shown"])
  for guard in ("collapse", "length"):
    n = _events(res, guard)
    rows.append([f"{guard} guard events (all seeds)", "", "", str(n), "none" if not n else "fired"])
  return markdown_table(["measure (mean of seeds)", f"step {res['runs'][next(iter(res['runs']))]['curve'][0]['step']}",
                         f"step {res['settings']['train.steps']}", "change, 95% interval across seeds", "verdict"],
                        rows)


def _events(res: dict, guard: str) -> int:
  """The `guard` guard's events over every seed (the length guard's say completions hit the cap, not collapse)."""
  return sum(e["event"].startswith("collapse") == (guard == "collapse") for run in res["runs"].values()
             for e in run["events"])


def pair_verdict(r: dict) -> str:
  """Closer on a measure: its interval excludes no change; the run as a whole: all three, no collapse event."""
  ok, events = closer(r), _events(r["result"], "collapse")
  shown = [MEASURES[k][0] for k, v in ok.items() if v]
  missing = [MEASURES[k][0] for k, v in ok.items() if not v]
  if not missing and not events:
    return "closer on all three measures, no collapse event"
  return (f"closer on {', '.join(shown) or 'no measure'}; not shown on {', '.join(missing) or 'none'}"
          f" (95% interval across seeds includes no change); {events} collapse event(s)")


def _plot(result: dict, path: str) -> str:
  import pair_recipe  # scripts/: its own figure

  return pair_recipe.plot(result, path)


FIGURES: dict[str, Figure] = {
    "pair_recipe": Figure((PAIR,), _read_json("pair_recipe.json"),
                          {"table": pair_table, "verdict": pair_verdict,
                           "seeds": lambda r: str(len(r["result"]["runs"]))},
                          images=(("docs/figures/pair_recipe.png", _plot),)),
}
