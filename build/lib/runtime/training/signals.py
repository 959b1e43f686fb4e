"""SIGTERM and SIGUSR1 as a request to stop at the next step boundary, on every rank alike."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Final, final

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE: Final = 75
"""``Trainer.run()`` returns it (EX_TEMPFAIL) after SIGTERM or SIGUSR1: a checkpoint was saved at the
step every rank agreed on; launch the same command again to resume."""

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGUSR1)


@final
class StopSignals:
    """While entered, turns the stop signals into :attr:`requested`; restores the handlers after.

    A handler only sets a flag: the loop reads it at the step boundary and all ranks agree on it
    there, so a signal to any one rank stops every rank at the same step. Outside the main thread
    (where Python cannot install handlers) it does nothing.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        self._previous = _install(self._request)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _restore(self._previous)
        self._previous = {}

    def _request(self, signum: int, _frame: FrameType | None) -> None:
        log.warning("Received %s: stopping at the next step boundary.", signal.Signals(signum).name)
        self.requested = True


class StartupInterrupted(Exception):
    """A stop signal arrived before training started."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"Received {signal.Signals(signum).name} before training started.")
        self.signum = signum


@final
class StartupSignals:
    """Until :meth:`disarm`, a stop signal raises :class:`StartupInterrupted` where the process is.

    Before the training loop there is no step boundary to stop at, so start-up (building the
    gangs, the model, the trainer) is abandoned instead: the command line exits with
    :data:`PREEMPTED_EXIT_CODE` before anything of the run is written. :class:`StopSignals` takes
    over once training starts; after :meth:`disarm` the default handlers are back.
    """

    def __init__(self) -> None:
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StartupSignals:
        self._previous = _install(self._raise)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disarm()

    def disarm(self) -> None:
        _restore(self._previous)
        self._previous = {}

    def _raise(self, signum: int, _frame: FrameType | None) -> None:
        # More signals of the storm must not interrupt the unwinding this one starts.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise StartupInterrupted(signum)


def _install(handler: Callable[[int, FrameType | None], None]) -> dict[signal.Signals, object]:
    """Route the stop signals to ``handler``; return the handlers they had. Python installs
    handlers only in the main thread: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _restore(previous: dict[signal.Signals, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
