"""Hooks around the training loop."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class TrainerCallback:
    """Override the moments you need; each default does nothing.

    The Trainer calls them on every rank, in the order documented in the README, with values it
    has at that moment anyway: a callback never causes a synchronization of its own.
    """

    def on_train_begin(self, *, step_nr: int) -> None:
        """Before the first step of this launch (``step_nr`` is the resumed step, or 0)."""

    def on_step_end(self, *, step_nr: int) -> None:
        """After each optimizer step. No values: reading them would sync the device."""

    def on_metrics_published(self, *, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        """After the values of ``run`` (``train``, ``valid``, ``valid/<name>``) were recorded."""

    def on_validation_end(
        self, *, step_nr: int, score: float | None, results: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """After all valid units ran; ``score`` is None without ``score_metric_name``."""

    def on_checkpoint_saved(self, *, step_nr: int, checkpoint_dir: Path) -> None:
        """After a checkpoint was committed (and retention applied)."""

    def on_early_stop(self, *, step_nr: int, score: float) -> None:
        """When the early stopper decided to stop, before the final checkpoint."""

    def on_train_end(self, *, step_nr: int) -> None:
        """After training finished (not after a preemption stop)."""
