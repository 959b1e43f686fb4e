"""The Trainer's side of checkpoints: saving its state, committing, retention, resuming."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

from torch.nn import Module
from torch.optim import Optimizer

from checkpoint import (
    AbstractCheckpointManager,
    CheckpointDirectoryError,
    CheckpointManager,
    LoadedCheckpoint,
    RetentionPolicy,
)
from checkpoint.exclusion import check_patterns
from checkpoint.manifest import resolve_step_dir
from checkpoint.storage import get_model_state
from gangs import Gangs
from runtime.training.validation import Scoring
from units.callback import TrainerCallback

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
    resume_from: Path | None = None
    """A ``step_N`` directory of any run, loaded in full when this run has no checkpoint yet."""
    exclude: tuple[str, ...] = ()
    """``fnmatch`` patterns of model entries left out of checkpoints."""

    def __post_init__(self) -> None:
        if self.resume_from is not None:
            resolve_step_dir(self.resume_from)


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
        optimizer: Optimizer | Sequence[Optimizer],
        callbacks: TrainerCallback,
        gangs: Gangs,
    ) -> None:
        self._manager = manager
        self.options = options
        self._scoring = scoring
        self._gangs = gangs
        self._model = model
        self._optimizer = optimizer
        self._callbacks = callbacks
        self.last_saved_step: int | None = None
        if options.exclude:
            check_patterns(list(get_model_state(model)), options.exclude)

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
            async_checkpoint=self.options.async_checkpoint,
            exclude=self.options.exclude,
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
            self.options.retention, lower_better=self._scoring.lower_better
        )
        self._callbacks.on_checkpoint_saved(
            step_nr=step_nr, checkpoint_dir=self._manager.checkpoint_path(step_nr)
        )

    def load_last(self) -> LoadedCheckpoint | None:
        """Prepare the manager (on the file system: check that all ranks share the directory,
        remove leftovers of interrupted saves), then load the newest intact checkpoint."""
        self._manager.prepare()
        if self.options.resume_from is not None:
            return self._load_resume_from(self.options.resume_from)
        loaded = self._manager.load_last_checkpoint(
            model=self._model, optimizer=self._optimizer, reshard=self.options.reshard_on_resume
        )
        if loaded is not None:
            self.last_saved_step = loaded.step_nr
        return loaded

    def load_before(self, step_nr: int) -> LoadedCheckpoint | None:
        """Mark the run's checkpoints from ``step_nr`` on unhealthy, then load the newest healthy
        one before it (None if there is none): the rollback from a loss spike at ``step_nr``."""
        manager = self._manager
        later = [info.step_nr for info in manager.list_checkpoints() if info.step_nr >= step_nr]
        if later:
            manager.mark_unhealthy(
                later, reason=f"saved after a loss spike began at step {step_nr}"
            )
        if manager.last_healthy_step(before=step_nr) is None:
            return None
        loaded = manager.load_last_checkpoint(model=self._model, optimizer=self._optimizer)
        if loaded is not None:
            self.last_saved_step = loaded.step_nr
        return loaded

    def _load_resume_from(self, path: Path) -> LoadedCheckpoint:
        """Load the full checkpoint ``path`` of another run; this run must have none of its own
        (it resumes from those, and two starting points would be a guess)."""
        own = self._manager.list_checkpoints()
        if own:
            where = self._manager.checkpoint_path(own[-1].step_nr)
            here = str(self._manager) if where is None else str(where.parent)
            raise CheckpointDirectoryError(
                f"The run's checkpoint directory {here} has checkpoints of its own (last: step "
                f"{own[-1].step_nr}), and resume_from names {path}. To continue this run, drop "
                "resume_from (--resume-from); to start from that checkpoint, pass a new OUTPUT_DIR."
            )
        checkpoint_dir, step_nr = resolve_step_dir(path)
        source = CheckpointManager(checkpoint_dir, self._gangs)
        try:
            return source.load_checkpoint(
                step_nr,
                model=self._model,
                optimizer=self._optimizer,
                reshard=self.options.reshard_on_resume,
            )
        finally:
            source.close()

    def load_initial_weights(self) -> None:
        """Load the model weights of ``init_from``, if given (a fresh run: nothing to resume)."""
        init_from = self.options.init_from
        if init_from is not None:
            from runtime.training.initial_weights import load_initial_weights

            load_initial_weights(self._model, init_from, gangs=self._gangs)
