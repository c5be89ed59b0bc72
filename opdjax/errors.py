"""Errors a user can cause: the CLI prints their message (which names the fix) and exits 2."""


class UserError(ValueError):
  pass


class Interrupted(KeyboardInterrupt):
  """Ctrl-C during a run, raised once the run's hooks have closed (checkpoints in flight are written):
  the CLI prints its one line (which step was interrupted, where the same command resumes) and exits 130."""

  def __init__(self, step: int, message: str = "", finished: int | None = None):
    super().__init__(message or f"interrupted during step {step}")
    self.step, self.finished = step, step - 1 if finished is None else finished


class ServerFailed(UserError):
  """A server the run depends on (a served teacher's) died, stopped answering or answered garbage. The loop
  adds the step; the run stops after its hooks closed (checkpoints in flight are written), and the same
  command resumes from the last complete checkpoint."""
