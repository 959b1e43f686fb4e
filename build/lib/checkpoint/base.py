"""What a training needs from checkpoint storage: the interface the Trainer depends on.

:class:`~checkpoint.manager.CheckpointManager` implements it over a directory that every rank
shares. Another storage (an object store, a database, memory in a test) implements the abstract
methods below; the others have defaults that fit a storage without background writes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from checkpoint.errors import CheckpointNotFoundError
from checkpoint.manifest import CheckpointChoice, choose_checkpoint
from checkpoint.retention import CheckpointInfo, RetentionPolicy


@dataclass(frozen=True)
class LoadedCheckpoint:
    step_nr: int
    trainer_state: dict[str, Any]
    manifest: dict[str, Any]
    resharded: bool = False
    """Saved by another world layout; ``trainer_state`` is rank 0's."""


class AbstractCheckpointManager(ABC):
    """Saves, lists, prunes and loads the checkpoints of one run.

    Every rank of the run makes the same calls in the same order. A checkpoint is committed
    (listed, loadable) only once complete; ``trainer_state`` is this rank's and comes back to
    this rank on load.
    """

    @abstractmethod
    def save_checkpoint(
        self,
        step_nr: int,
        *,
        model: Module,
        optimizer: Optimizer | Sequence[Optimizer],
        trainer_state: Mapping[str, Any],
        score: float | None = None,
        async_checkpoint: bool = False,
        exclude: Sequence[str] = (),
    ) -> None:
        """Save model, optimizer and trainer state of ``step_nr`` with its validation ``score``.

        ``optimizer`` is the Trainer's one optimizer, or the sequence of its several.
        The model entries that a pattern of ``exclude`` matches (``fnmatch``) are left out, and
        a load keeps what the model holds for them (see :mod:`checkpoint.exclusion`).

        Returns once committed; an implementation that writes in the background may return
        earlier when ``async_checkpoint`` is set, with :attr:`pending_step_nr` set until
        :meth:`finish_pending_save` commits it.
        """

    @abstractmethod
    def load_last_checkpoint(
        self, *, model: Module, optimizer: Optimizer | Sequence[Optimizer], reshard: bool = False
    ) -> LoadedCheckpoint | None:
        """Load the newest full checkpoint into ``model`` and ``optimizer``; None if none."""

    @abstractmethod
    def load_model(self, step_nr: int, *, model: Module) -> None:
        """Load only the model of the checkpoint of ``step_nr``."""

    @abstractmethod
    def list_checkpoints(self) -> list[CheckpointInfo]:
        """The committed checkpoints, oldest first."""

    @abstractmethod
    def apply_retention(self, policy: RetentionPolicy, *, lower_better: bool = True) -> None:
        """Delete (or prune to the model) what ``policy`` does not keep; see
        :func:`~checkpoint.retention.plan_retention`."""

    @abstractmethod
    def mark_unhealthy(self, step_nrs: Sequence[int], *, reason: str) -> None:
        """Mark the committed checkpoints of ``step_nrs`` unhealthy, durably: from then on none
        of them is resumed from, or counted as the last or the best, and retention keeps them.

        Marking deletes nothing and is idempotent (a marked checkpoint keeps its first
        ``reason``). A save in flight commits first, so its step may be among ``step_nrs``.
        Raises :class:`CheckpointNotFoundError` (marking none) if a step has no committed
        checkpoint. Every rank makes the call.
        """

    def is_healthy(self, step_nr: int) -> bool:
        """Whether the committed checkpoint of ``step_nr`` is healthy (not marked unhealthy);
        :class:`CheckpointNotFoundError` if there is none."""
        for info in self.list_checkpoints():
            if info.step_nr == step_nr:
                return info.healthy
        raise CheckpointNotFoundError(f"There is no committed checkpoint of step {step_nr}.")

    def last_healthy_step(self, before: int | None = None) -> int | None:
        """The step of the newest healthy full checkpoint, of a step below ``before`` if given:
        where a rollback goes. None if there is none. Only committed checkpoints count, so call
        :meth:`finish_pending_save` first for a save in flight to count."""
        steps = [
            info.step_nr
            for info in self.list_checkpoints()
            if info.healthy and info.kind == "full" and (before is None or info.step_nr < before)
        ]
        return max(steps, default=None)

    @property
    def pending_step_nr(self) -> int | None:
        """The step of a save not committed yet (background writes), if there is one."""
        return None

    def finish_pending_save(self) -> int | None:
        """Commit the save in flight, if any, and return its step."""
        return None

    def prepare(self) -> None:  # noqa: B027 - optional: most storages need no preparation
        """Get ready before the training loads or saves anything (check the storage, clean up
        what an interrupted save left)."""

    def select_checkpoint(self, which: CheckpointChoice, *, lower_better: bool) -> int:
        """The step of the committed checkpoint ``which`` (``"last"``, ``"best"`` or a step)."""
        return choose_checkpoint(
            self.list_checkpoints(), which, lower_better=lower_better, where=str(self)
        )

    def checkpoint_path(self, step_nr: int) -> Path | None:
        """Where the checkpoint of ``step_nr`` lives on the file system; None if elsewhere."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: most storages hold nothing to release
        """Wait for background work and release what it holds (threads, process groups);
        commits nothing. Every rank calls it."""
