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
