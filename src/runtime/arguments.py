"""Checks of arguments, worded the same everywhere in the runtime.

The numeric checks live in ``checkpoint.arguments``, the lowest package that needs them (its
retention policy checks its counts), so that both packages word them alike.
"""

from __future__ import annotations

from checkpoint.arguments import check_not_negative, check_positive, check_same_length

__all__ = ["check_not_negative", "check_positive", "check_same_length"]
