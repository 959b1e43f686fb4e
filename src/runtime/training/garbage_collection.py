"""Python's garbage collection on a schedule every rank shares.

A rank that collects on its own schedule stalls the others in the next collective; with
``gc_every_n_steps`` automatic collection is off during training and every rank collects after
the same steps.
"""

from __future__ import annotations

import gc
from types import TracebackType
from typing import final

from runtime.training.schedule import Schedule


@final
class GarbageCollection:
    def __init__(self, every_n_steps: int | None) -> None:
        self.schedule = Schedule("gc", every_n_steps=every_n_steps)
        """The steps to collect after: the loop looks ahead to them, and :meth:`after_step`
        collects on them."""
        self._was_enabled = False

    def __enter__(self) -> GarbageCollection:
        if self.schedule.is_set:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.schedule.is_set and self._was_enabled:
            gc.enable()

    def after_step(self, step_nr: int) -> None:
        if self.schedule.due_after_step(step_nr):
            gc.collect()
