"""CPU rollout throughput of the embedded `JaxEngine`: this working tree's version against an older git ref,
side by side in one run.

    PYTHONPATH=. python bench/engine_versions.py   # ~4 min on an idle 2-core box: HEAD vs the worktree
    PYTHONPATH=. python bench/engine_versions.py --before 5daaaa2 --rounds 5 --out FILE

The older tree is checked out with `git worktree add --detach` into a temporary folder (removed at the end).
Every (version, shape) measurement is its own subprocess, `PYTHONPATH` at that tree (the child checks that
`opdjax` comes from there), pinned to `--threads` cores; the rounds alternate before, after, before, after, so
drift in the box's load hits both. Both versions get the same prompts and model config, built here from this
tree; the weights are random (`model.init`, key 0), fp32, nothing downloaded. No EOS (`eos_ids=()`), so every
row generates exactly `max_new_tokens` tokens; sampling at temperature 1.

Shapes:
- demo: the offline demo's student and rollout (configs/demo.py: `demo_model_config` of the student's
  hidden, layers and heads, llama family; `rollout.batch_size` prompts of the addition task, `<bos>a+b=`
  with `task.max_digits` digits, `rollout.max_new_tokens` new tokens, `rollout.max_len`);
- smollm2: SmolLM2-135M's shape (llama, hidden 576, 30 layers, 9 heads / 3 kv heads, head_dim 64,
  intermediate 1536, vocab 49152, tied embeddings) at configs/smollm2_opd.py's rollout (batch 8, 32 new
  tokens, max_len 96), random prompts of 40 tokens: the chat template's system turn (about 30 tokens)
  and a short question, as opdjax/data/chat_prompts.jsonl's are (an estimate: no tokenizer is read here).

Each child builds the engine (timed: the newer engine compiles and runs its weight preparation there), makes
one warm-up call (compile + first call) and then times `--repeats` calls of each path:
- generate: `engine.generate` with the weights unchanged (the steady state of the sampling loop);
- sync + generate: `engine.sync(params, version)` then `generate`, what a training step pays (the OPD loop
  installs a new weight version before every rollout; the newer engine prepares its fused weights there).
  The first `SYNC_WARMUP` such calls of a process are recorded apart: an engine that copies its weights at
  install faults the new buffers in page by page until glibc stops handing freed ones back to the kernel.
Reported per child: median wall seconds, tokens/s on the wall clock and per CPU second (user + sys of the
process over the timed calls; jobs sharing the box slow the wall clock, not the work), the sys seconds and
minor page faults a call. Per shape: the median over rounds with the min-max range, after / before per round
(each round's pair measured back to back), and a verdict for the wall clock and for CPU time: faster or
slower in every round, or within the round-to-round spread. What a sync costs = the sync + generate median
minus the generate median (wall and CPU seconds).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 8192}
SMOLLM2_PROMPT = 40  # tokens: the chat template's system turn and a short question (see the docstring)
CORE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
               "max_position_embeddings", "dtype")
PATHS = ("generate", "sync_generate")
KEEP_CALLS = 20  # a child's timed calls kept one by one in the result up to this many a path
SYNC_WARMUP = 2  # sync + generate calls before the timed ones (recorded apart: see `child`)


# --- the shapes, built in the parent from this tree --------------------------------

def demo_shape() -> dict:
  """configs/demo.py's student and rollout, with one batch of the task's prompts."""
  import dataclasses

  import numpy as np

  from opdjax.config.loader import load_config_file
  from opdjax.tasks.addition import AdditionTask
  from opdjax.tasks.demo_models import demo_model_config

  c = load_config_file(os.path.join(ROOT, "configs", "demo.py"))
  s, r = c.student, c.rollout
  cfg = dataclasses.asdict(demo_model_config(s.hidden_size, s.num_layers, s.num_heads))
  task = AdditionTask(max_digits=c.task.max_digits)
  prompts = [task.prompt(int(a), int(b)) for a, b in task.sample_pairs(np.random.default_rng(0), r.batch_size)]
  return {"model": {k: cfg[k] for k in CORE_FIELDS}, "batch": r.batch_size, "new": r.max_new_tokens,
          "max_len": r.max_len, "prompts": prompts, "source": "configs/demo.py (student, rollout, task)"}


def smollm2_shape() -> dict:
  import numpy as np

  from opdjax.config.loader import load_config_file

  r = load_config_file(os.path.join(ROOT, "configs", "smollm2_opd.py")).rollout
  prompts = np.random.default_rng(0).integers(3, SMOLLM2["vocab_size"], (r.batch_size, SMOLLM2_PROMPT)).tolist()
  return {"model": {**SMOLLM2, "dtype": "float32"}, "batch": r.batch_size, "new": r.max_new_tokens,
          "max_len": r.max_len, "prompts": prompts,
          "source": "SmolLM2-135M's shape, random weights; configs/smollm2_opd.py's rollout"}


SHAPES = {"demo": demo_shape, "smollm2": smollm2_shape}


def shape_line(name: str, spec: dict) -> str:
  m, lens = spec["model"], [len(p) for p in spec["prompts"]]
  plen = f"{min(lens)}-{max(lens)}" if min(lens) != max(lens) else f"{lens[0]}"
  return (f"{name}: {m['model_type']} hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads /"
          f" {m['num_kv_heads']} kv heads, head_dim {m['head_dim']}, intermediate {m['intermediate_size']}, vocab"
          f" {m['vocab_size']}{', tied embeddings' if m['tie_word_embeddings'] else ''}, {m['dtype']}; batch"
          f" {spec['batch']}, prompts of {plen} tokens, {spec['new']} new tokens, max_len {spec['max_len']}")


# --- child: one version, one shape -------------------------------------------------

def quartiles(xs: list[float]) -> dict:
  return dict(zip(("min", "p25", "median", "p75", "max"), (min(xs), *statistics.quantiles(xs, n=4), max(xs))))


def child(spec_path: str, tree: str, repeats: int) -> None:
  spec = json.load(open(spec_path))
  import jax

  import opdjax
  from opdjax.models import Model, ModelConfig
  from opdjax.rollout import JaxEngine, SamplingParams

  if not os.path.abspath(opdjax.__file__).startswith(os.path.join(os.path.abspath(tree), "")):
    raise SystemExit(f"opdjax imported from {opdjax.__file__}, not from {tree}: PYTHONPATH must point there")
  model = Model(ModelConfig(**spec["model"]))
  params = jax.block_until_ready(jax.jit(model.init)(jax.random.key(0)))
  sampling = SamplingParams(max_new_tokens=spec["new"], temperature=1.0)
  want = spec["batch"] * spec["new"]

  def usage(fn):
    """`(wall, CPU and sys seconds and minor page faults of fn(), fn())`. The sys share is the kernel's:
    page faults on freshly mapped buffers among it."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    wall, cpu, out = _common.timed(fn)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": wall, "cpu_s": cpu, "sys_s": after.ru_stime - before.ru_stime,
            "minor_faults": after.ru_minflt - before.ru_minflt}, out

  def call(seed: int, version: int | None = None):
    if version is not None:
      engine.sync(params, version)
    r = engine.generate(spec["prompts"], sampling, seed=seed)
    jax.block_until_ready(r.completion_tokens)
    got = int(r.completion_mask.sum())
    if got != want:
      raise SystemExit(f"generated {got} tokens, expected {want} (batch x max_new_tokens)")
    return r

  # The newer engine compiles and dispatches its weight preparation here; the first call waits for it.
  build, engine = usage(lambda: JaxEngine(model, params, max_len=spec["max_len"], pad_id=0, eos_ids=()))
  first, _ = usage(lambda: call(0))
  load0 = os.getloadavg()[0]
  seeds = iter(range(1, 10**6))

  def measured(version: bool) -> dict:
    seed = next(seeds)
    return usage(functools.partial(call, seed, seed if version else None))[0]

  out = {}
  for path in PATHS:
    sync = path == "sync_generate"
    # The first weight installs of the process fault their new buffers in page by page (glibc hands freed
    # ones back to the kernel until its thresholds adapt): recorded apart, not in the steady-state median.
    warm = [measured(sync) for _ in range(SYNC_WARMUP if sync else 0)]
    calls = [measured(sync) for _ in range(repeats)]
    med = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
    # every call of a short list; a long one (the demo's) as its quartiles, to keep the result file small
    kept = ({"calls": calls} if len(calls) <= KEEP_CALLS else
            {"call_quartiles": {k: quartiles([c[k] for c in calls]) for k in calls[0]}})
    out[path] = {**kept, "warmup_calls": warm, **{f"median_{k}": v for k, v in med.items()},
                 "tokens_per_s": want / med["wall_s"], "tokens_per_cpu_s": want / med["cpu_s"]}
  _common.emit({"opdjax": os.path.dirname(opdjax.__file__), "jax": jax.__version__, "build": build, "first_call": first,
                "compile_s": build["wall_s"] + first["wall_s"], "compile_cpu_s": build["cpu_s"] + first["cpu_s"],
                "tokens_per_call": want, "cores": len(os.sched_getaffinity(0)),
                "load": [round(load0, 2), round(os.getloadavg()[0], 2)], **out})


# --- parent ------------------------------------------------------------------------

def git(*args: str, cwd: str = ROOT) -> str:
  return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def code_digest(tree: str) -> str:
  """sha256 (12 hex) of the opdjax package's Python files as they are on disk in `tree`: the code a child ran."""
  h = hashlib.sha256()
  pkg = os.path.join(tree, "opdjax")
  for d, dirs, files in sorted(os.walk(pkg)):
    dirs[:] = sorted(x for x in dirs if x != "__pycache__")
    for f in sorted(x for x in files if x.endswith(".py")):
      path = os.path.join(d, f)
      h.update(os.path.relpath(path, tree).encode() + b"\0" + open(path, "rb").read())
  return h.hexdigest()[:12]


def tree_state(tree: str) -> dict:
  """A tree's commit (with " (tracked files modified)" when its files differ from it) and its code's digest."""
  from opdjax.analyses import reporting

  return {"commit": reporting.git_commit(tree), "opdjax_sha256": code_digest(tree)}


def spread(xs: list[float]) -> dict:
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def summarise(runs: list[dict]) -> dict:
  """Per path: both versions' figures over rounds, and after / before per round."""
  by = {v: [r for r in runs if r["version"] == v] for v in ("before", "after")}

  def each(f) -> dict:
    return {v: spread([f(r) for r in rs]) for v, rs in by.items()}

  def warm(r, key):  # the SYNC_WARMUP first sync + generate calls, each over the generate median
    return statistics.mean(c[key] for c in r["sync_generate"]["warmup_calls"]) - r["generate"][f"median_{key}"]

  out = {k: each(lambda r, k=k: r[k]) for k in ("compile_s", "compile_cpu_s")}
  for what in ("build", "first_call"):  # build_wall_s, build_cpu_s, build_sys_s, first_call_...
    out.update({f"{what}_{k}": each(lambda r, what=what, k=k: r[what][k]) for k in ("wall_s", "cpu_s", "sys_s")})
  # what installing a weight version adds to a call: each child's two medians, differenced
  for unit, key in (("s", "wall_s"), ("cpu_s", "cpu_s")):
    out[f"sync_{unit}"] = each(lambda r, key=key: r["sync_generate"][f"median_{key}"] - r["generate"][f"median_{key}"])
    out[f"first_syncs_{unit}"] = each(lambda r, key=key: warm(r, key))
  for path in PATHS:
    res = {}
    for key in ("tokens_per_s", "tokens_per_cpu_s", "median_wall_s"):
      res[key] = {v: spread([r[path][key] for r in rs]) for v, rs in by.items()}
    for key, name in (("tokens_per_s", "ratio"), ("tokens_per_cpu_s", "cpu_ratio")):
      ratios = [a[path][key] / b[path][key] for a, b in zip(by["after"], by["before"])]
      res[name] = spread(ratios)
    res["median_sys_s"] = {v: spread([r[path]["median_sys_s"] for r in rs]) for v, rs in by.items()}
    res["median_minor_faults"] = {v: spread([r[path]["median_minor_faults"] for r in rs]) for v, rs in by.items()}
    for name, verdict in (("ratio", "verdict"), ("cpu_ratio", "cpu_verdict")):
      r = res[name]
      res[verdict] = (
          "after faster in every round" if r["min"] > 1 else
          "after slower in every round" if r["max"] < 1 else "within the round-to-round spread")
    out[path] = res
  return out


def _range(s: dict, fmt: str = "{:,.0f}") -> str:
  return f"{fmt.format(s['median'])} ({fmt.format(s['min'])} to {fmt.format(s['max'])})"


def markdown(result: dict) -> str:
  label = {"generate": "generate", "sync_generate": "sync + generate"}
  head = ["shape", "call", "before tokens/s", "after tokens/s", "after / before", "before tokens/CPU-s",
          "after tokens/CPU-s", "after / before (CPU)"]
  rows = []
  for name, s in result["shapes"].items():
    for path in PATHS:
      x = s[path]
      rows.append([name, label[path], _range(x["tokens_per_s"]["before"]), _range(x["tokens_per_s"]["after"]),
                   f"**{_range(x['ratio'], '{:.2f}x')}**", _range(x["tokens_per_cpu_s"]["before"]),
                   _range(x["tokens_per_cpu_s"]["after"]), _range(x["cpu_ratio"], "{:.2f}x")])

  def cell(x: dict, cpu: dict, v: str, fmt: str) -> str:
    return f"{_range(x[v], fmt)}; CPU {fmt.format(cpu[v]['median'])}"

  costs = []
  for name, s in result["shapes"].items():
    faults = s["sync_generate"]["median_minor_faults"]
    costs.append([name, f"{s['batch']} x {s['prompt_width']} + {s['new']}",
                  *(cell(s[k], s[f"{k[:-2]}_cpu_s"], v, fmt)
                    for k, fmt in (("compile_s", "{:.2f}"), ("sync_s", "{:.3f}"), ("first_syncs_s", "{:.3f}"))
                    for v in ("before", "after")),
                  f"{faults['before']['median']:,.0f} / {faults['after']['median']:,.0f}"])
  costs_head = ["shape", "batch x padded prompt + new", "engine built + first call, before (s)", "after (s)",
                "sync's cost a call, before (s)", "after (s)", f"sync's cost, first {SYNC_WARMUP} calls, before (s)",
                "after (s)", "page faults a sync + generate call, before / after"]
  return "\n\n".join([_common.markdown_table(head, rows), _common.markdown_table(costs_head, costs)])


def setup_lines(result: dict) -> list[str]:
  b, a = result["before"], result["after"]
  reps = ", ".join(f"{n} {k}" for n, k in result["repeats"].items())
  changed = " (**changed during the run**)" if "changed_during_run" in a else ""
  return [*(f"- {s['line']} ({s['source']})" for s in result["shapes"].values()),
          f"- before: `{b['ref']}` = {b['commit']} (a `git worktree`), opdjax/ digest {b['opdjax_sha256']}; after:"
          f" the working tree at {a['commit']}, opdjax/ digest {a['opdjax_sha256']}{changed}",
          f"- {result['rounds']} round(s) of before then after, each a subprocess pinned to {result['threads']}"
          f" core(s): engine built, one warm-up call, then timed calls a path ({reps}; sync + generate after"
          f" {result['sync_warmup']} more, reported apart)"]


def summary_lines(result: dict) -> list[str]:
  label = {"generate": "generate", "sync_generate": "sync + generate"}
  out = [f"- {n}: " + "; ".join(f"{label[p]} after / before {s[p]['ratio']['median']:.2f}x on the wall clock,"
                                f" {s[p]['verdict']}, {s[p]['cpu_ratio']['median']:.2f}x in CPU time,"
                                f" {s[p]['cpu_verdict']}" for p in PATHS) for n, s in result["shapes"].items()]
  for n, s in result["shapes"].items():
    after = {k: s["sync_generate"][f"median_{k}"]["after"]["median"] for k in ("sys_s", "minor_faults")}
    med = {k: {v: s[k][v]["median"] for v in ("before", "after")}
           for k in ("build_cpu_s", "build_sys_s", "first_call_cpu_s", "first_call_sys_s")}
    out.append(f"- {n}, where the time goes (CPU seconds, medians; sys: the kernel's share): engine built"
               f" {med['build_cpu_s']['after']:.2f} (sys {med['build_sys_s']['after']:.2f}) + first call"
               f" {med['first_call_cpu_s']['after']:.2f} after, {med['build_cpu_s']['before']:.2f} +"
               f" {med['first_call_cpu_s']['before']:.2f} before; after's sync + generate call spends"
               f" {after['sys_s']:.3f} s in the kernel ({after['minor_faults']:,.0f} page faults), its generate alone"
               f" {s['generate']['median_sys_s']['after']['median']:.3f} s")
  la = result["load_average"]
  out.append(f"- load average {la['start']:.1f} at the start, {la['end']:.1f} at the end,"
             f" {la['runs_min_max'][0]:.1f}-{la['runs_min_max'][1]:.1f} over the children, on {la['cores']} cores;"
             f" {result['wall_s']:.0f} s in all")
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--before", default="HEAD", help="the git ref to compare against (default HEAD)")
  ap.add_argument("--rounds", type=int, default=3, help="before, after rounds (default 3)")
  ap.add_argument("--repeats", default="demo=200,smollm2=4",
                  help="timed calls a path in each child, per shape (default demo=200,smollm2=4: a demo call is"
                       " milliseconds, a smollm2 call seconds)")
  ap.add_argument("--threads", type=int, default=1, help="cores each child is pinned to (default 1)")
  ap.add_argument("--shapes", default="demo,smollm2", help="comma-separated: demo, smollm2")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "engine_versions.json"),
                  help="the JSON result (default bench/results/engine_versions.json)")
  ap.add_argument("--child", nargs=3, metavar=("SPEC", "TREE", "REPEATS"), help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    _common.pin_cpu_threads(int(os.environ["ENGINE_VERSIONS_THREADS"]))
    return child(args.child[0], args.child[1], int(args.child[2]))

  load0, t0 = os.getloadavg(), time.time()
  names = args.shapes.split(",")
  repeats = {k: int(v) for k, v in (p.split("=") for p in args.repeats.split(","))}
  unknown = [n for n in names if n not in SHAPES or n not in repeats]
  if unknown:
    raise SystemExit(f"--shapes / --repeats: {', '.join(unknown)} unknown or without repeats; shapes:"
                     f" {', '.join(SHAPES)}")
  specs = {n: SHAPES[n]() for n in names}
  tmp = tempfile.mkdtemp(prefix="engine-versions-")
  before_tree = os.path.join(tmp, "before")
  try:
    git("worktree", "add", "--detach", before_tree, args.before)
  except subprocess.CalledProcessError as e:
    shutil.rmtree(tmp)
    raise SystemExit(f"--before {args.before}: `git worktree add` failed: {e.stderr.strip()}") from None
  trees = {"before": before_tree, "after": ROOT}
  runs = {n: [] for n in names}
  try:
    states = {"before": {"ref": args.before, **tree_state(before_tree)},
              "after": {"tree": "this working tree", **tree_state(ROOT)}}
    spec_paths = {}
    for n, spec in specs.items():
      spec_paths[n] = os.path.join(tmp, f"{n}.json")
      json.dump(spec, open(spec_paths[n], "w"))
    for i in range(args.rounds):
      for n in names:
        for version in ("before", "after"):
          print(f"engine_versions: round {i + 1}/{args.rounds}, {n}, {version}", flush=True)
          env = {"PYTHONPATH": trees[version], "JAX_PLATFORMS": "cpu", "ENGINE_VERSIONS_THREADS": str(args.threads)}
          res = _common.run_child(os.path.abspath(__file__),
                                  ["--child", spec_paths[n], trees[version], str(repeats[n])], env)
          runs[n].append({"version": version, "round": i, **res})
  finally:
    git("worktree", "remove", "--force", before_tree)
    shutil.rmtree(tmp)

  changed = code_digest(ROOT) != states["after"]["opdjax_sha256"]  # another hand edited the code meanwhile
  if changed:
    states["after"]["changed_during_run"] = tree_state(ROOT)
  result = {"bench": "engine_versions",
            "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
            "machine": _common.cpu_description() + f"; each child pinned to {args.threads} core(s)",
            "command": "PYTHONPATH=. python " + _common.command_line(), **states,
            "commit": states["after"]["commit"], "rounds": args.rounds, "repeats": repeats,
            "threads": args.threads, "sync_warmup": SYNC_WARMUP, "shapes": {}}
  for n, spec in specs.items():
    lens = [len(p) for p in spec["prompts"]]
    width = -(-max(lens) // 8) * 8  # opdjax.rollout.base.pad_prompts' multiple of 8
    result["shapes"][n] = {"line": shape_line(n, spec), "source": spec["source"], "model": spec["model"],
                           "batch": spec["batch"], "new": spec["new"], "max_len": spec["max_len"],
                           "prompt_lengths": [min(lens), max(lens)], "prompt_width": width,
                           **summarise(runs[n]), "runs": runs[n]}
  seen = [load0[0], *(x for rs in runs.values() for r in rs for x in r["load"])]
  result["load_average"] = {"start": round(load0[0], 2), "end": round(os.getloadavg()[0], 2),
                            "runs_min_max": [round(min(seen), 2), round(max(seen), 2)], "cores": os.cpu_count()}
  result["wall_s"] = round(time.time() - t0, 1)

  print("\n" + "\n".join(setup_lines(result)) + "\n\n" + markdown(result) + "\n\n" + "\n".join(summary_lines(result)))
  if changed:
    print(f"engine_versions: WARNING: opdjax/ in {ROOT} changed during the run; the after side is not one version")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  sys.exit(main())
