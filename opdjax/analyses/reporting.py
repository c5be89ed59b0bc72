"""Writing analysis outputs: JSON, CSV, markdown tables and PNG plots, each written atomically.

A file either does not exist or is complete: every writer goes through a temporary file in the
same folder and `os.replace`. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import subprocess
from collections.abc import Sequence


def _atomic_write(path: str, data: bytes) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)
  return path


def _plain(x):
  """NumPy/JAX scalars and arrays as Python numbers and lists."""
  if hasattr(x, "tolist"):
    return x.tolist()
  raise TypeError(f"{type(x).__name__} is not JSON serializable")


def write_json(path: str, obj) -> str:
  return _atomic_write(path, (json.dumps(obj, indent=2, default=_plain) + "\n").encode())


def git_commit(root: str) -> str:
  """The commit a result is measured at, for its record: the short hash of `root`'s checkout, with
  " (tracked files modified)" when the worktree differs from it; "unknown" outside a git checkout."""
  def git(*args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout.strip()

  try:
    head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + (" (tracked files modified)" if dirty else "")


def record_digest(obj: dict) -> str:
  """sha256 of the record's canonical JSON without its own `digest` field: written with the record
  by the command that ran, so a field edited afterwards no longer matches (scripts/docs.py checks)."""
  body = {k: v for k, v in obj.items() if k != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True, default=_plain).encode()).hexdigest()


def write_csv(path: str, rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
  columns = list(columns or (rows[0].keys() if rows else []))
  buf = io.StringIO()
  w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
  w.writeheader()
  w.writerows(rows)
  return _atomic_write(path, buf.getvalue().encode())


def _cell(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def markdown_table(rows: Sequence[dict | Sequence], columns: Sequence[str] | None = None) -> str:
  """Rows as dicts (cells by column name) or as lists of cells in the order of `columns`."""
  columns = list(columns or (rows[0].keys() if rows else []))
  lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
  lines += ["| " + " | ".join(_cell(x) for x in (r if not isinstance(r, dict) else [r.get(c, "") for c in columns]))
            + " |" for r in rows]
  return "\n".join(lines)


def write_text(path: str, text: str) -> str:
  return _atomic_write(path, text.encode())


def figure(*args, **kw):
  """A matplotlib (fig, axes) on the Agg backend."""
  import matplotlib

  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt

  return plt.subplots(*args, **kw)


def save_figure(fig, path: str) -> str:
  import matplotlib.pyplot as plt

  buf = io.BytesIO()
  fig.tight_layout()
  fig.savefig(buf, format="png", dpi=120)
  plt.close(fig)
  return _atomic_write(path, buf.getvalue())
