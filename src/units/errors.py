"""Errors a unit raises that the command line reports in one line."""

from __future__ import annotations


class UserFunctionError(RuntimeError):
    """A function of the user's that a unit calls (a GRPO reward function) failed or returned
    what it must not; the message names it. ``python -m recipes...`` stops with this one
    ``error:`` line and exit status 1 (the traceback goes to the rank's log)."""
