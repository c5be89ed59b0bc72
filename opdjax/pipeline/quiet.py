"""What Orbax's and TensorStore's threads print around a failed restore, kept off the user's terminal:
the error a user reads is one line (opdjax.pipeline.checkpoint), the rest goes to the run's error log."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import traceback


class HeldStderr:
  """Holds file descriptor 2 in a file while Orbax restores: replayed if the restore succeeds, kept
  in `text` (for the error log) if it fails, so that what TensorStore prints does not bury the error."""

  def __init__(self):
    self.text = ""

  def __enter__(self):
    sys.stderr.flush()
    self._saved, self._held = os.dup(2), tempfile.TemporaryFile()
    os.dup2(self._held.fileno(), 2)
    return self

  def __exit__(self, exc_type, exc, tb):
    sys.stderr.flush()
    os.dup2(self._saved, 2)
    os.close(self._saved)
    self._held.seek(0)
    text = self._held.read().decode(errors="replace")
    self._held.close()
    if exc_type is None:
      sys.stderr.write(text)
    else:
      self.text = text
    return False


class LoopClosedNoise:
  """After a failed restore, TensorStore completes the reads still in flight and calls back into the
  asyncio loop Orbax ran the restore on, which is closed by then: each callback raises "Event loop is
  closed" in a TensorStore thread, reported through sys.unraisablehook: tens of tracebacks, from just
  before the error reaches us to milliseconds after. Installed before each restore (the first ones
  come before it returns), this hook keeps them for the error log (`route_to`) instead of stderr;
  anything else unraisable goes to the hook that was there."""

  log: str | None = None
  pending: list[str] = []  # before a failed restore names its log

  @classmethod
  def install(cls) -> None:
    if getattr(sys.unraisablehook, "_opdjax_loop_closed", False):
      return
    previous = sys.unraisablehook

    def hook(u):
      if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
        return previous(u)
      text = "".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback))
      if cls.log is None:
        if len(cls.pending) < 10_000:
          cls.pending.append(text)
        return
      try:
        with open(cls.log, "a") as f:
          f.write(text)
      except OSError:
        pass

    hook._opdjax_loop_closed = True
    sys.unraisablehook = hook

  @classmethod
  def route_to(cls, log: str) -> None:
    cls.log = log
    kept, cls.pending = cls.pending, []
    try:
      with open(log, "a") as f:
        f.writelines(kept)
    except OSError:
      pass


@contextlib.contextmanager
def ctrl_c_held(reraise: bool = True):
  """Holds a Ctrl-C (SIGINT, and SIGTERM, which the run passes through it) that lands inside, and raises it as
  KeyboardInterrupt at the end: around Orbax's saves (interrupted inside, its thread join logs an ERROR and may
  leave the save unfinished) and around a step's update and its record (interrupted between them, the state
  would be a step ahead of what was logged, and the last finished step could not be checkpointed). Off the main
  thread (no signals arrive there) it does nothing."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  held = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
  try:
    yield
  finally:  # (None: a handler not set from Python; the default one raises KeyboardInterrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
  if held and reraise:
    raise KeyboardInterrupt
