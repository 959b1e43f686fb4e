"""Errors of the training loop."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """The training cannot go on: the data or the unit broke an invariant the Trainer needs."""
