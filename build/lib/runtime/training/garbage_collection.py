"""Python's garbage collection on a schedule every rank shares.

A rank that collects on its own schedule stalls the others in the next collective; with
``gc_every_n_steps`` automatic collection is off during training and every rank collects after
the same steps.
"""

from __future__ import annotations

import gc
from types import TracebackType
from typing import final


@final
class GarbageCollection:
    """While entered with ``scheduled``, Python's automatic collection is off: the loop collects
    on the schedule instead (``Schedules.collect_garbage``)."""

    def __init__(self, *, scheduled: bool) -> None:
        self._scheduled = scheduled
        self._was_enabled = False

    def __enter__(self) -> GarbageCollection:
        if self._scheduled:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._scheduled and self._was_enabled:
            gc.enable()
