"""Progress for commands: a tqdm bar on a terminal, plain lines in a log (one every `every_s` seconds
and one at the end), never carriage-return frames or cursor escapes in a file."""

from __future__ import annotations

import sys
import time


class _Lines:
  def __init__(self, iterable, desc: str, total: int | None, every_s: float, stream):
    self.iterable, self.desc, self.every_s, self.stream = iterable, desc, every_s, stream
    self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
    self.n, self.last, self.postfix = 0, time.time(), ""

  def _say(self, force: bool = False) -> None:
    if force or time.time() - self.last >= self.every_s:
      self.last = time.time()
      of = f"/{self.total}" if self.total else ""
      print(f"{self.desc}: {self.n}{of} {self.postfix}".rstrip(), file=self.stream, flush=True)

  def update(self, n: int = 1) -> None:
    self.n += n
    self._say(force=self.total is not None and self.n >= self.total)

  def set_postfix(self, d=None, **kw) -> None:
    self.postfix = " ".join(f"{k}={v}" for k, v in {**(d or {}), **kw}.items())

  def __iter__(self):
    for x in self.iterable:
      yield x
      self.update()

  def close(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def bar(iterable=None, *, desc: str, total: int | None = None, enabled: bool = True, every_s: float = 30.0,
        stream=None, **tqdm_kw):
  """`tqdm(iterable, desc=...)` on a terminal; periodic plain lines otherwise; nothing when disabled."""
  stream = stream or sys.stderr
  if not enabled:
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=True)
  if stream.isatty():
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, file=stream, **tqdm_kw)
  return _Lines(iterable if iterable is not None else (), desc, total, every_s, stream)
