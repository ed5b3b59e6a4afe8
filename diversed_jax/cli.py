"""What the command-line entry points (`main`, `generate`, `training`, `distill`) share."""

from __future__ import annotations

import contextlib

from absl import app


@contextlib.contextmanager
def usage_errors(prefix: str = ""):
  """Within it, a ValueError from a validator (which names the bad field and its value)
  ends the program as absl's usage error, `prefix` + its message, without a traceback: a
  bad value on the command line is the user's input, not a failure of the program."""
  try:
    yield
  except ValueError as error:
    raise app.UsageError(f"{prefix}{error}") from None
