"""The hooks around the training loop that users subclass: :class:`TrainerCallback`.

``runtime`` exports it and calls it (``runtime.training.callbacks``); it lives here, beside the
units, so that the parts ``models`` ships (the experts' bias update) can be callbacks too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.nn import Module


class TrainerCallback:
    """Override the moments you need; each default does nothing.

    The Trainer calls them on every rank, with values it has at that moment anyway: a callback
    never causes a synchronization of its own. Values are the same on every rank (the batches
    of ``on_step_begin`` are this rank's). The order in one launch of ``Trainer.run()``:

    1. ``on_train_begin`` (``step_nr`` is the resumed step, or 0); on a fresh run then
       ``on_epoch_begin`` of data epoch 1.
    2. With ``validate_at_start`` on a fresh run, a validation at step 0 (see 4).
    3. For each step: ``on_step_begin`` (with the step's micro-batches), the forward and backward
       passes, ``on_before_optimizer_step`` (gradients final: normalized, unscaled, clipped;
       not called on a step that is skipped), the optimizer step; then, when due,
       ``on_metrics_published(run="train")``; then ``on_step_end`` (with the published values,
       or None); then a validation (4) on the step schedule; then ``on_checkpoint_saved`` when a
       checkpoint is due. When the reader runs out of data after step N: ``on_out_of_data``,
       the validation and checkpoint of the epoch schedules (same order), ``on_epoch_end``, and,
       unless the training ends there, ``on_epoch_begin`` of the next data epoch. With a
       ``loss_spike_guard``, a spike found at a publish or before a checkpoint rolls back
       instead (``on_rollback``), and the steps go on from the checkpoint's.
    4. A validation: ``on_metrics_published`` once per valid unit in the order of ``valid_units``
       (``run`` is ``valid`` or ``valid/<display_name>``), then ``on_validation_end``, then
       ``on_early_stop`` if the early stopper decided to stop (never at step 0).
    5. When the training ends (max steps or epochs, the end of the data, or an early stop): the
       train metrics not yet published, a final validation unless the last step had one, a
       final checkpoint unless the last step had one (each with its callbacks as above), then
       ``on_train_end``.

    With ``async_checkpoint=True``, ``on_checkpoint_saved`` of a step comes when its save has
    committed: just before the next save starts, or at the end of ``run()`` (before
    ``on_train_end``). A preemption (SIGTERM/SIGUSR1) ends with ``on_checkpoint_saved`` and no
    ``on_train_end``. A launch that finds the run finished already calls nothing. An exception
    raised by a callback propagates out of ``run()``.

    A callback that also has ``state_dict()`` and ``load_state_dict(state)`` is saved with the
    trainer state of every checkpoint and restored on resume (see :class:`CallbackList`).
    """

    def on_train_begin(self, *, step_nr: int) -> None:
        """Before the first step of this launch (``step_nr`` is the resumed step, or 0)."""

    def on_epoch_begin(self, *, epoch_nr: int, step_nr: int) -> None:
        """Before the first step of data epoch ``epoch_nr`` (after step ``step_nr``)."""

    def on_step_begin(self, *, step_nr: int, batches: Sequence[Any]) -> None:
        """Before the forward pass of step ``step_nr``, with its micro-batches on this rank."""

    def on_before_optimizer_step(self, *, step_nr: int, model: Module) -> None:
        """After the gradients of ``model`` are final (normalized over the step's targets,
        reduced over the data-parallel gang, unscaled and clipped), before the optimizer
        steps. Changing them here (a custom clipping, say) changes the update."""

    def on_step_end(self, *, step_nr: int, metrics: Mapping[str, Any] | None) -> None:
        """After each optimizer step. ``metrics`` are the train values published after this step
        (on the steps that publish), None otherwise: reading values on the other steps would
        sync the device."""

    def on_out_of_data(self, *, step_nr: int, epoch_nr: int) -> None:
        """When the data reader ran out of data epoch ``epoch_nr`` after step ``step_nr``."""

    def on_epoch_end(self, *, epoch_nr: int, step_nr: int) -> None:
        """After data epoch ``epoch_nr`` ended and its validation and checkpoint (when due) ran."""

    def on_metrics_published(self, *, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        """After ``values`` of ``run`` (``train``, ``valid``, ``valid/<name>``) were recorded."""

    def on_validation_end(
        self, *, step_nr: int, score: float | None, results: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """After all valid units ran. ``results`` maps each run name to its values; ``score`` is
        their combined score (the mean over units of ``score_metric_name``), None without one."""

    def on_checkpoint_saved(self, *, step_nr: int, checkpoint_dir: Path | None) -> None:
        """After a checkpoint was committed (and retention applied). ``checkpoint_dir`` is its
        directory (None from a checkpoint manager that keeps it off the file system)."""

    def on_early_stop(self, *, step_nr: int, score: float) -> None:
        """When the early stopper decided to stop, before the final checkpoint."""

    def on_rollback(self, *, from_step: int, to_step: int) -> None:
        """After a loss spike at ``from_step`` rolled the training back to the checkpoint of
        ``to_step`` (weights, optimizer and trainer state reloaded, the stateful callbacks
        included, and the data moved past the spike); the next step is ``to_step + 1``."""

    def on_train_end(self, *, step_nr: int) -> None:
        """After training finished (not after a preemption stop)."""
