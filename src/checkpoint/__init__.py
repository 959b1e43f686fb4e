"""Checkpoints that are complete and loadable, or invisible."""

from __future__ import annotations

from checkpoint.manager import (
    CheckpointChoice,
    CheckpointError,
    CheckpointLayoutError,
    CheckpointManager,
    CheckpointNotFoundError,
    LoadedCheckpoint,
)
from checkpoint.retention import (
    CheckpointInfo,
    RetentionPlan,
    RetentionPolicy,
    best_checkpoint,
    plan_retention,
)

__all__ = [
    "CheckpointChoice",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointLayoutError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "LoadedCheckpoint",
    "RetentionPlan",
    "RetentionPolicy",
    "best_checkpoint",
    "plan_retention",
]
