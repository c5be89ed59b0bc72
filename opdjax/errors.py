"""Errors a user can cause: the CLI prints their message (which names the fix) and exits 2."""


class UserError(ValueError):
  pass
