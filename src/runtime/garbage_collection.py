"""Python's garbage collection on a schedule every rank shares.

A rank that collects on its own schedule stalls the others in the next collective; with
``gc_every_n_steps`` automatic collection is off during training and every rank collects after
the same steps.
"""

from __future__ import annotations

import gc
from types import TracebackType
from typing import final

from runtime.arguments import check_positive


@final
class GarbageCollection:
    def __init__(self, every_n_steps: int | None) -> None:
        check_positive("gc_every_n_steps", every_n_steps)
        self._every_n_steps = every_n_steps
        self._was_enabled = False

    def __enter__(self) -> GarbageCollection:
        if self._every_n_steps is not None:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._every_n_steps is not None and self._was_enabled:
            gc.enable()

    def after_step(self, step_nr: int) -> None:
        if self._every_n_steps is not None and step_nr % self._every_n_steps == 0:
            gc.collect()
