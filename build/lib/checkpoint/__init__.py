"""Checkpoints that are complete and loadable, or invisible."""

from __future__ import annotations

from checkpoint.base import AbstractCheckpointManager, LoadedCheckpoint
from checkpoint.errors import (
    CheckpointDirectoryError,
    CheckpointError,
    CheckpointLayoutError,
    CheckpointLoadError,
    CheckpointNotFoundError,
)
from checkpoint.layout import WorldLayout
from checkpoint.manager import CheckpointManager
from checkpoint.manifest import CheckpointChoice
from checkpoint.retention import (
    CheckpointInfo,
    RetentionPlan,
    RetentionPolicy,
    best_checkpoint,
    plan_retention,
)

__all__ = [
    "AbstractCheckpointManager",
    "CheckpointChoice",
    "CheckpointDirectoryError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointLayoutError",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "LoadedCheckpoint",
    "RetentionPlan",
    "RetentionPolicy",
    "WorldLayout",
    "best_checkpoint",
    "plan_retention",
]
