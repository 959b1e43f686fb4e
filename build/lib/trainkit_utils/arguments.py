"""Checks of arguments, worded the same in every package."""

from __future__ import annotations

from collections.abc import Sized


def check_positive(name: str, value: float | None) -> None:
    """``value`` must be greater than zero; ``None`` (not set) passes."""
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be greater than zero, but is {value} instead.")


def check_not_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be zero or more, but is {value} instead.")


def check_same_length(name: str, items: Sized, other_name: str, other_items: Sized) -> None:
    if len(items) != len(other_items):
        raise ValueError(
            f"{name} and {other_name} must have the same length, but have {len(items)} and "
            f"{len(other_items)} elements instead."
        )
