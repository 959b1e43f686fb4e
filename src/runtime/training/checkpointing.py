"""The Trainer's side of checkpoints: saving its state, committing, retention, resuming."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, final

from torch.nn import Module
from torch.optim import Optimizer

from checkpoint import AbstractCheckpointManager, LoadedCheckpoint, RetentionPolicy
from gangs import Gangs
from runtime.training.callbacks import TrainerCallback
from runtime.training.validation import Scoring

if TYPE_CHECKING:
    from runtime.training.initial_weights import InitFrom


@final
@dataclass(frozen=True)
class CheckpointOptions:
    """The Trainer's checkpoint arguments besides the schedule."""

    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    async_checkpoint: bool = False
    reshard_on_resume: bool = False
    init_from: InitFrom | None = None


@final
class Checkpointer:
    """Saves full checkpoints of the training through ``manager`` and keeps what the retention
    policy keeps (ranked by ``scoring``); tells the callbacks about each commit."""

    def __init__(
        self,
        *,
        manager: AbstractCheckpointManager,
        options: CheckpointOptions,
        scoring: Scoring,
        model: Module,
        optimizer: Optimizer,
        callbacks: TrainerCallback,
        gangs: Gangs,
    ) -> None:
        self._manager = manager
        self._options = options
        self._scoring = scoring
        self._gangs = gangs
        self._model = model
        self._optimizer = optimizer
        self._callbacks = callbacks
        self.last_saved_step: int | None = None

    @property
    def manager(self) -> AbstractCheckpointManager:
        return self._manager

    def save(self, step_nr: int, *, trainer_state: Mapping[str, Any], score: float | None) -> None:
        # Retention and the callbacks see only committed checkpoints, so the previous
        # asynchronous save commits first.
        self.finish_pending_save()
        self._manager.save_checkpoint(
            step_nr,
            model=self._model,
            optimizer=self._optimizer,
            trainer_state=trainer_state,
            score=score,
            async_checkpoint=self._options.async_checkpoint,
        )
        self.last_saved_step = step_nr
        if self._manager.pending_step_nr is None:
            self._after_commit(step_nr)

    def finish_pending_save(self) -> None:
        """Wait for an asynchronous save in flight and commit it (every rank must call it)."""
        step_nr = self._manager.finish_pending_save()
        if step_nr is not None:
            self._after_commit(step_nr)

    def _after_commit(self, step_nr: int) -> None:
        self._manager.apply_retention(
            self._options.retention, lower_better=self._scoring.lower_better
        )
        self._callbacks.on_checkpoint_saved(
            step_nr=step_nr, checkpoint_dir=self._manager.checkpoint_path(step_nr)
        )

    def load_last(self) -> LoadedCheckpoint | None:
        """Prepare the manager (on the file system: check that all ranks share the directory,
        remove leftovers of interrupted saves), then load the newest intact checkpoint."""
        self._manager.prepare()
        loaded = self._manager.load_last_checkpoint(
            model=self._model, optimizer=self._optimizer, reshard=self._options.reshard_on_resume
        )
        if loaded is not None:
            self.last_saved_step = loaded.step_nr
        return loaded

    def load_initial_weights(self) -> None:
        """Load the model weights of ``init_from``, if given (a fresh run: nothing to resume)."""
        init_from = self._options.init_from
        if init_from is not None:
            from runtime.training.initial_weights import load_initial_weights

            load_initial_weights(self._model, init_from, gangs=self._gangs)
