"""What goes wrong with checkpoints."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or a stored one is damaged or does not fit this run."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint matches the request."""


class CheckpointLayoutError(CheckpointError):
    """An intact checkpoint was saved by another world layout (world, DP or TP size)."""


class CheckpointDirectoryError(CheckpointError):
    """The ranks do not share one checkpoint directory (no shared filesystem)."""
