"""The Trainer's side of checkpoints: saving its state, committing, retention, resuming."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, final

from torch.nn import Module
from torch.optim import Optimizer

from checkpoint import CheckpointManager, LoadedCheckpoint, RetentionPolicy
from gangs import Gangs
from runtime.callbacks import TrainerCallback


@final
class Checkpointer:
    """Saves full checkpoints of the training through ``manager`` and keeps what ``retention``
    keeps; tells the callbacks about each commit."""

    def __init__(
        self,
        *,
        manager: CheckpointManager,
        retention: RetentionPolicy,
        model: Module,
        optimizer: Optimizer,
        async_checkpoint: bool,
        reshard_on_resume: bool,
        callbacks: TrainerCallback,
        gangs: Gangs,
        init_from: Path | None = None,
    ) -> None:
        self._manager = manager
        self._gangs = gangs
        self._init_from = init_from
        self._retention = retention
        self._model = model
        self._optimizer = optimizer
        self._async = async_checkpoint
        self._reshard_on_resume = reshard_on_resume
        self._callbacks = callbacks
        self.last_saved_step: int | None = None

    @property
    def manager(self) -> CheckpointManager:
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
            async_checkpoint=self._async,
        )
        self.last_saved_step = step_nr
        if not self._async:
            self._after_commit(step_nr)

    def finish_pending_save(self) -> None:
        """Wait for an asynchronous save in flight and commit it (every rank must call it)."""
        step_nr = self._manager.finish_pending_save()
        if step_nr is not None:
            self._after_commit(step_nr)

    def close(self) -> None:
        self._manager.close()

    def _after_commit(self, step_nr: int) -> None:
        self._manager.apply_retention(self._retention)
        self._callbacks.on_checkpoint_saved(
            step_nr=step_nr, checkpoint_dir=self._manager.checkpoint_dir / f"step_{step_nr}"
        )

    def load_last(self) -> LoadedCheckpoint | None:
        """Check that all ranks share the checkpoint directory, remove leftovers of interrupted
        saves, then load the newest intact checkpoint."""
        self._manager.check_shared_directory()
        self._manager.remove_leftovers()
        loaded = self._manager.load_last_checkpoint(
            model=self._model, optimizer=self._optimizer, reshard=self._reshard_on_resume
        )
        if loaded is not None:
            self.last_saved_step = loaded.step_nr
        return loaded

    def load_initial_weights(self) -> None:
        """Load the model weights of ``init_from``, if given (a fresh run: nothing to resume)."""
        if self._init_from is not None:
            from runtime.init_weights import load_initial_weights

            load_initial_weights(self._model, self._init_from, gangs=self._gangs)
