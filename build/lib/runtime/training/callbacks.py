"""The Trainer's callbacks called in order, and the state of those that have some."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, final

from torch.nn import Module

from runtime.training.state import Stateful
from units.callback import TrainerCallback


@final
class CallbackList(TrainerCallback):
    """Calls each of ``callbacks`` in order, one moment at a time; :meth:`add` appends one."""

    def __init__(self, callbacks: Sequence[TrainerCallback]) -> None:
        self._callbacks: list[TrainerCallback] = []
        for callback in callbacks:
            self.add(callback)

    def add(self, callback: TrainerCallback) -> None:
        if not isinstance(callback, TrainerCallback):
            raise TypeError(
                f"callbacks must be TrainerCallback objects, but got {type(callback).__name__}."
            )
        self._callbacks.append(callback)

    def stateful(self) -> dict[str, Stateful]:
        """The callbacks with a state, by a name that stays the same across launches of the
        same code: ``callbacks.<ClassName>`` (``.<K>`` from the second of a class on)."""
        named: dict[str, Stateful] = {}
        for callback in self._callbacks:
            if isinstance(callback, Stateful):
                name = f"callbacks.{type(callback).__name__}"
                count = sum(1 for key in named if key.split(".")[1] == type(callback).__name__)
                named[name if count == 0 else f"{name}.{count}"] = callback
        return named

    def on_train_begin(self, *, step_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_train_begin(step_nr=step_nr)

    def on_epoch_begin(self, *, epoch_nr: int, step_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_epoch_begin(epoch_nr=epoch_nr, step_nr=step_nr)

    def on_step_begin(self, *, step_nr: int, batches: Sequence[Any]) -> None:
        for callback in self._callbacks:
            callback.on_step_begin(step_nr=step_nr, batches=batches)

    def on_before_optimizer_step(self, *, step_nr: int, model: Module) -> None:
        for callback in self._callbacks:
            callback.on_before_optimizer_step(step_nr=step_nr, model=model)

    def on_step_end(self, *, step_nr: int, metrics: Mapping[str, Any] | None) -> None:
        for callback in self._callbacks:
            callback.on_step_end(step_nr=step_nr, metrics=metrics)

    def on_out_of_data(self, *, step_nr: int, epoch_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_out_of_data(step_nr=step_nr, epoch_nr=epoch_nr)

    def on_epoch_end(self, *, epoch_nr: int, step_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_epoch_end(epoch_nr=epoch_nr, step_nr=step_nr)

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

    def on_rollback(self, *, from_step: int, to_step: int) -> None:
        for callback in self._callbacks:
            callback.on_rollback(from_step=from_step, to_step=to_step)

    def on_train_end(self, *, step_nr: int) -> None:
        for callback in self._callbacks:
            callback.on_train_end(step_nr=step_nr)
