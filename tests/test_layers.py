"""The package's layers only point down, and no modules import each other in a circle.

Every `import` of an opdjax module is read from the source (function-level imports too: a lazy import
that climbs is still a climb). A package may import from its own floor or below; `LAYERS` is the
pipeline's order, lowest first (README.md, "Layout"). Inside rollout/ the two engine families never
import each other: the one place that knows both is rollout/deploy.py.
"""

from __future__ import annotations

import ast
import pathlib

import opdjax

ROOT = pathlib.Path(opdjax.__file__).parent

LAYERS = (
    ("opdjax.errors", "opdjax.progress", "opdjax.seeds", "opdjax.paths"),
    ("opdjax.parallel",),  # mesh axis names, partition rules, activation hints, placement
    ("opdjax.models",),
    ("opdjax.rollout",),
    ("opdjax.views",),
    ("opdjax.scoring",),
    ("opdjax.training",),
    ("opdjax.tasks", "opdjax.data"),
    ("opdjax.config",),
    ("opdjax.pipeline",),
    ("opdjax.analyses",),
    ("opdjax.cli", "opdjax.commands", "opdjax.api"),  # the CLI and the Python API, which it calls
)


def _module(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module(p): p for p in ROOT.rglob("*.py")}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
  """The opdjax modules `path` imports (`from opdjax import seeds` names the module opdjax.seeds)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("opdjax")}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("opdjax"):
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        out.add(sub if sub in known else node.module)
  return out - {"opdjax"}


def _floor(module: str) -> int:
  if module == "opdjax":  # the package's __init__ re-exports the Python API (opdjax.train): the top floor
    return len(LAYERS) - 1
  for i, names in enumerate(LAYERS):
    if any(module == n or module.startswith(n + ".") for n in names):
      return i
  raise AssertionError(f"{module} is on no floor of LAYERS: add its package there")


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  known = set(mods)
  return {m: _imports(p, known) for m, p in mods.items()}


def test_every_import_points_down_or_sideways():
  climbs = [f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
            for m, targets in sorted(_graph().items()) for t in sorted(targets) if _floor(t) > _floor(m)]
  assert not climbs, "imports that climb a layer:\n" + "\n".join(climbs)


def test_no_import_circles():
  graph = _graph()
  # A package's __init__ re-exporting its modules is not a circle with them.
  graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
  state: dict[str, int] = {}
  cycles = []

  def visit(m, stack):
    state[m] = 1
    for t in sorted(graph.get(m, ())):
      if state.get(t) == 1:
        cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
      elif t not in state:
        visit(t, stack + [t])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_check_sees_a_climb():
  """The walker finds the imports it must judge (a check that cannot fail is no check)."""
  graph = _graph()
  assert "opdjax.parallel.activations" in graph["opdjax.models.decoder"]
  assert _floor("opdjax.cli") > _floor("opdjax.pipeline.run") > _floor("opdjax.rollout.deploy")
  assert "opdjax.rollout.jax.engine" in graph["opdjax.rollout.deploy"]
  assert "opdjax.rollout.vllm.launch" in graph["opdjax.rollout.deploy"]


FAMILIES = ("opdjax.rollout.jax", "opdjax.rollout.vllm")


def test_the_engine_families_never_import_each_other():
  crossings = [f"{m} imports {t}" for m, targets in sorted(_graph().items()) for t in sorted(targets)
               for a, b in (FAMILIES, FAMILIES[::-1]) if _in(m, a) and _in(t, b)]
  assert not crossings, "engine families importing each other:\n" + "\n".join(crossings)
  # ... and the check sees imports inside a family (a walker that finds nothing passes everything)
  assert "opdjax.rollout.vllm.server" in _graph()["opdjax.rollout.vllm.launch"]


def test_rollouts_top_level_holds_the_protocol_the_seam_and_the_families():
  top = sorted(p.name for p in (ROOT / "rollout").iterdir() if p.name != "__pycache__")
  # children.py: how both families start a process that dies with the trainer (one bootstrap)
  assert top == ["__init__.py", "base.py", "children.py", "cores.py", "deploy.py", "jax", "sampling.py", "vllm"], top


def _in(module: str, package: str) -> bool:
  return module == package or module.startswith(package + ".")
