"""A daemon thread that prepares the steps of an epoch ahead of the training loop."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, final

from runtime.data.data_reader import DataReaderError

BatchT = TypeVar("BatchT")


@dataclass(frozen=True)
class PreparedStep(Generic[BatchT]):
    step_nr: int
    batches: list[BatchT]
    error: Exception | None = None


@final
class Prefetcher(Generic[BatchT]):
    """Prepares ``steps`` in order with ``make_step`` into a queue of ``capacity`` steps.

    ``make_step`` runs on the thread, so it must not use collectives. An exception it raises is
    handed over as the step's ``error``, after which the thread stops.
    """

    def __init__(
        self,
        *,
        make_step: Callable[[int], list[BatchT]],
        steps: range,
        capacity: int,
        name: str,
    ) -> None:
        self._queue: queue.Queue[PreparedStep[BatchT]] = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_prefetch,
            args=(make_step, steps, self._queue, self._stop),
            name=name,
            daemon=True,
        )
        self._thread.start()

    def get(self) -> PreparedStep[BatchT]:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                # The thread puts before it exits, so a dead thread and an empty queue is final.
                if not self._thread.is_alive() and self._queue.empty():
                    raise DataReaderError(
                        f"The prefetch thread {self._thread.name} exited without preparing the "
                        "next step; an error that is not an Exception stopped it. Check the "
                        "log for its traceback, or use num_prefetch=0 to read in this thread."
                    ) from None

    def close(self) -> None:
        self._stop.set()
        # Emptying the queue wakes a thread blocked in put; it then sees the stop event.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()


def _prefetch(
    make_step: Callable[[int], list[BatchT]],
    steps: range,
    out: queue.Queue[PreparedStep[BatchT]],
    stop: threading.Event,
) -> None:
    # A function, not a method: the thread must hold no reference to the reader, so a dropped
    # reader is collected and its __del__ stops the thread.
    for step_nr in steps:
        if stop.is_set():
            return
        try:
            prepared = PreparedStep(step_nr, make_step(step_nr))
        except Exception as ex:
            prepared = PreparedStep(step_nr, [], error=ex)
        out.put(prepared)
        if prepared.error is not None:
            return
