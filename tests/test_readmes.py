"""scripts/README.md and bench/README.md name every file of their folder, one list line each."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {"__pycache__", "results", "wheels"}  # caches, run outputs, downloaded wheels: not the folder's files


def files(folder: str, root: str = ROOT) -> list[str]:
  out = []
  for d, dirs, names in os.walk(os.path.join(root, folder)):
    dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".")]
    out += [os.path.relpath(os.path.join(d, n), os.path.join(root, folder)) for n in names
            if n != "README.md" and not n.startswith(".") and not n.endswith(".pyc")]
  return sorted(out)


def listed(folder: str, root: str = ROOT) -> set[str]:
  """The files a README lists: a list line that starts with the file's name in backticks."""
  text = open(os.path.join(root, folder, "README.md")).read()
  return set(re.findall(r"^- `([^`]+)`", text, re.M))


@pytest.mark.parametrize("folder", ["scripts", "bench"])
def test_every_file_is_listed_in_its_folders_readme(folder):
  have = files(folder)
  assert len(have) > 10  # the walk found the folder's files
  missing = sorted(set(have) - listed(folder))
  assert not missing, f"{folder}/README.md does not list {', '.join(missing)}: add one line a file"
  stale = sorted(listed(folder) - set(have))
  assert not stale, f"{folder}/README.md lists {', '.join(stale)}, which {folder}/ does not have"


def test_a_file_missing_from_its_readme_is_found(tmp_path):
  (tmp_path / "bench").mkdir()
  for name in ("a.py", "b.py"):
    (tmp_path / "bench" / name).write_text("")
  (tmp_path / "bench" / "README.md").write_text("- `a.py`: one.\n")
  assert set(files("bench", str(tmp_path))) - listed("bench", str(tmp_path)) == {"b.py"}


def layout_names(guide: str, root: str = ROOT) -> set[str]:
  """The package modules docs/guide.md's layout table names, as paths from the repository root. A row's
  folders are its package cell's (`opdjax/x/`, and the folder of a file there); a backticked `name.py` (or
  `sub/name.py`) anywhere in the row names that file in each of them where it exists, `opdjax/...py` itself."""
  section = guide.split("## Layout", 1)[1].split("\n## ", 1)[0]
  names = set()
  for row in (line for line in section.splitlines() if line.startswith("| ") and line.count("|") >= 4):
    cells = [c.strip() for c in row.strip("|").split("|")]
    items = re.findall(r"`([^`]+)`", row)
    bases = {x if x.endswith("/") else os.path.dirname(x) + "/" for x in re.findall(r"`(opdjax/[^`]*)`", cells[1])}
    for item in items:
      if not item.endswith(".py") or "*" in item:
        continue
      paths = [item] if item.startswith("opdjax/") else [b + item for b in bases]
      names |= {p for p in paths if os.path.isfile(os.path.join(root, p))} or {f"(none of) {'|'.join(paths)}"}
  return names


def modules(root: str = ROOT) -> set[str]:
  """Every module of the package (faces, `__init__.py`, aside)."""
  return {os.path.join("opdjax", f) for f in files("opdjax", root) if f.endswith(".py") and
          os.path.basename(f) != "__init__.py"}


def test_the_guides_layout_table_names_every_module():
  have, named = modules(), layout_names(open(os.path.join(ROOT, "docs", "guide.md")).read())
  assert len(have) > 100  # the walk found the package
  missing = sorted(have - named)
  assert not missing, f"docs/guide.md's layout table does not name {', '.join(missing)}: add each to its row"
  stale = sorted(named - have)
  assert not stale, f"docs/guide.md's layout table names {', '.join(stale)}, which the package does not have"


def test_a_module_missing_from_the_layout_table_is_named(tmp_path):
  for path in ("opdjax/a.py", "opdjax/pipeline/b.py", "opdjax/rollout/jax/c.py", "opdjax/rollout/jax/d.py"):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text("")
  guide = ("## Layout\n\n| stage | package | modules |\n| --- | --- | --- |\n| floor | `opdjax/a.py` | errors |\n"
           "| loop | `opdjax/pipeline/` | `b.py`, `c.py` (not here), `gone.py` |\n"
           "| engines | `opdjax/rollout/` | `jax/c.py` |\n\n## Next\n`d.py`\n")
  named = layout_names(guide, str(tmp_path))
  assert sorted(modules(str(tmp_path)) - named) == ["opdjax/rollout/jax/d.py"]  # named outside the table
  assert {"opdjax/a.py", "opdjax/pipeline/b.py", "opdjax/rollout/jax/c.py"} <= named
  assert "(none of) opdjax/pipeline/gone.py" in named  # a name the package lacks is stale
