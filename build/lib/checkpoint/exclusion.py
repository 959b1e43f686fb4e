"""Parameters and buffers left out of checkpoints (a frozen table loaded from elsewhere, say).

The Trainer's ``checkpoint_exclude`` patterns (``fnmatch``, over the names of the model's state
dict as checkpoints store them: without DDP's ``module.`` prefix) pick them. A save leaves them
out and lists them in the manifest under ``excluded``; a load reads that list and keeps, for
each, what the model holds (what it was built or initialized with).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Any


def excluded_names(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The ``names`` that any of ``patterns`` matches, sorted."""
    if not patterns:
        return []
    return sorted(name for name in names if any(fnmatchcase(name, p) for p in patterns))


def check_patterns(names: Sequence[str], patterns: Sequence[str]) -> None:
    """ValueError for a pattern that matches none of ``names``: a typo would otherwise save
    everything, silently."""
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            examples = ", ".join(names[:5])
            raise ValueError(
                f"The checkpoint_exclude pattern {pattern!r} matches no parameter or buffer of "
                f"the model. Names look like: {examples}."
            )


def pop_entries(state: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """Remove ``names`` from ``state`` and return them (names ``state`` lacks are skipped)."""
    return {name: state.pop(name) for name in names if name in state}
