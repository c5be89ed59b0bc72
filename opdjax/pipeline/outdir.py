"""One policy for every command's --out: everything is checked before anything is created, a folder
holding anything else is refused (or, with --overwrite, written into: the command's own files are
replaced, nothing else is touched), and a resumable run of ours is resumed, never clobbered."""

from __future__ import annotations

import os

from opdjax.errors import UserError

RUN_MARKER = ".opdjax-run"  # written first by `opdjax train`: this folder is an opdjax run


class OutDirError(UserError):
  pass


def check_out_dir(out_dir: str, command: str, overwrite: bool, own: bool = False) -> None:
  """Refuses an --out that is a file, or a non-empty folder that is not this command's own
  resumable state (`own`), unless `overwrite`. Creates nothing."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise OutDirError(f"--out {out_dir} is a file; give a folder (new or empty) for `opdjax {command}`'s outputs.")
  if own or overwrite or not os.path.isdir(out_dir) or not os.listdir(out_dir):
    return
  listed = ", ".join(sorted(os.listdir(out_dir))[:4])
  why = (f"holds no opdjax {command} run to resume" if command == "train"
         else f"`opdjax {command}` does not resume into a used folder")
  raise OutDirError(f"--out {out_dir} is not empty ({listed}, ...) and {why}; pass a new --out folder, or"
                    " --overwrite to write this command's files into it (nothing was written).")


def is_run_dir(out_dir: str) -> bool:
  return os.path.exists(os.path.join(out_dir, RUN_MARKER)) or os.path.isdir(os.path.join(out_dir, "checkpoints"))


def mark_run_dir(out_dir: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, RUN_MARKER), "a"):
    pass
