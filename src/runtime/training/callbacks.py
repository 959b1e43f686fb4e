"""Hooks around the training loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, final


class TrainerCallback:
    """Override the moments you need; each default does nothing.

    The Trainer calls them on every rank, with values it has at that moment anyway: a callback
    never causes a synchronization of its own. Values are the same on every rank. The order in
    one launch of ``Trainer.run()``:

    1. ``on_train_begin`` (``step_nr`` is the resumed step, or 0).
    2. With ``validate_at_start`` on a fresh run, a validation at step 0 (see 4).
    3. For each step: ``on_step_end``; then, when due, ``on_metrics_published(run="train")``; then a
       validation (4) on the step schedule; then ``on_checkpoint_saved`` when a checkpoint is due.
       A data epoch that ends after step N validates and checkpoints on the epoch schedules
       before step N + 1 starts, in the same order.
    4. A validation: ``on_metrics_published`` once per valid unit in the order of ``valid_units``
       (``run`` is ``valid`` or ``valid/<display_name>``), then ``on_validation_end``, then
       ``on_early_stop`` if the early stopper decided to stop (never at step 0).
    5. When the training ends (max steps or epochs, or an early stop): the train metrics not yet
       published, a final validation unless the last step had one, a final checkpoint unless the
       last step had one (each with its callbacks as above), then ``on_train_end``.

    With ``async_checkpoint=True``, ``on_checkpoint_saved`` of a step comes when its save has
    committed: just before the next save starts, or at the end of ``run()`` (before
    ``on_train_end``). A preemption (SIGTERM/SIGUSR1) ends with ``on_checkpoint_saved`` and no
    ``on_train_end``. A launch that finds the run finished already calls nothing. An exception
    raised by a callback propagates out of ``run()``.
    """

    def on_train_begin(self, *, step_nr: int) -> None:
        """Before the first step of this launch (``step_nr`` is the resumed step, or 0)."""

    def on_step_end(self, *, step_nr: int) -> None:
        """After each optimizer step. No values: reading them would sync the device."""

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

    def on_train_end(self, *, step_nr: int) -> None:
        """After training finished (not after a preemption stop)."""


@final
class CallbackList(TrainerCallback):
    """Calls each of ``callbacks`` in order, one moment at a time."""

    def __init__(self, callbacks: Sequence[TrainerCallback]) -> None:
        self._callbacks = list(callbacks)

    def on_train_begin(self, *, step_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_train_begin(step_nr=step_nr)

    def on_step_end(self, *, step_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_step_end(step_nr=step_nr)

    def on_metrics_published(self, *, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        for callback in self._callbacks:
            callback.on_metrics_published(run=run, step_nr=step_nr, values=values)

    def on_validation_end(
        self, *, step_nr: int, score: float | None, results: Mapping[str, Mapping[str, Any]]
    ) -> None:
        for callback in self._callbacks:
            callback.on_validation_end(step_nr=step_nr, score=score, results=results)

    def on_checkpoint_saved(self, *, step_nr: int, checkpoint_dir: Path | None) -> None:
        for callback in self._callbacks:
            callback.on_checkpoint_saved(step_nr=step_nr, checkpoint_dir=checkpoint_dir)

    def on_early_stop(self, *, step_nr: int, score: float) -> None:
        for callback in self._callbacks:
            callback.on_early_stop(step_nr=step_nr, score=score)

    def on_train_end(self, *, step_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_train_end(step_nr=step_nr)
