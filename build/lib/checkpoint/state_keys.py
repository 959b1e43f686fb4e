"""Checking a section of a loaded checkpoint: it must hold exactly the keys its owner saves."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from checkpoint.errors import CheckpointError


def check_state_keys(state: Mapping[str, Any], expected: Collection[str], *, what: str) -> None:
    """Raise CheckpointError unless ``state`` has exactly the ``expected`` keys."""
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"lacks {', '.join(missing)}")
        if unknown:
            problems.append(f"has unknown entries {', '.join(unknown)}")
        raise CheckpointError(
            f"The {what} state of the checkpoint {' and '.join(problems)}, so it was not saved by "
            "this version of the runtime or this Trainer. Resume with the version and settings "
            "that saved it, or start the run in a fresh output directory."
        )
