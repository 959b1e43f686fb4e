"""Errors of the training loop."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """The training cannot go on: the data or the unit broke an invariant the Trainer needs."""


class NonFiniteError(TrainerError):
    """The run cannot go on numerically: a non-finite loss or gradient with ``nan_policy="error"``,
    too many non-finite steps in a row with ``"skip"``, or an fp16 loss scale below its minimum."""
