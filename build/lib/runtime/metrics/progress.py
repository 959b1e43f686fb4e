"""The console progress display of rank 0: a rich progress bar when attached to a terminal.

Without a terminal (a log file, CI, a torchrun child whose output is piped) the display is off, and
the log line of each publish is the plain progress report.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, final

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID


class ProgressDisplay:
    """Shows the step and the latest published values; the default shows nothing.

    ``advance`` runs once per step, so it must not read device
    values: the Trainer passes values only at publish time, when they are on the host anyway.
    """

    def start(self, *, total_steps: int | None, initial_step: int) -> None:
        pass

    def advance(self, *, step_nr: int) -> None:
        pass

    def update_values(self, values: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


LOSS_AVERAGE_WINDOW = 10
"""How many recent publishes the progress bar's ``loss_avg`` averages."""


@final
class LossAverage:
    """The moving average of the loss over the last ``window`` publishes (a smoother trend
    than one publish's value, which covers only the steps since the one before)."""

    def __init__(self, window: int = LOSS_AVERAGE_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be greater than zero, but is {window} instead.")
        self._losses: deque[float] = deque(maxlen=window)

    def add(self, loss: float) -> float:
        """Add the loss of one publish; return the average of the window."""
        self._losses.append(loss)
        return sum(self._losses) / len(self._losses)


@final
class RichProgressDisplay(ProgressDisplay):
    """A progress bar with the step, ETA, and the loss (with its moving average over recent
    publishes, ``loss_avg``), learning rate and gradient norm."""

    def __init__(self, console: Console | None = None) -> None:
        # Imported here: only a terminal shows the bar, and rich takes a while to import.
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[values]}"),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._task: TaskID | None = None
        self._loss_average = LossAverage()

    def start(self, *, total_steps: int | None, initial_step: int) -> None:
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=initial_step, values=""
        )

    def advance(self, *, step_nr: int) -> None:
        if self._task is not None:
            self._progress.update(self._task, completed=step_nr)

    def update_values(self, values: Mapping[str, float]) -> None:
        if self._task is not None:
            text = "  ".join(f"{name} {value:.4g}" for name, value in self.shown(values).items())
            self._progress.update(self._task, values=text)

    def shown(self, values: Mapping[str, float]) -> dict[str, float]:
        """The values of a publish as the bar shows them: ``loss_avg`` after ``loss``."""
        shown: dict[str, float] = {}
        for name, value in values.items():
            shown[name] = value
            if name == "loss":
                shown["loss_avg"] = self._loss_average.add(value)
        return shown

    def close(self) -> None:
        self._progress.stop()
        self._task = None


def make_progress_display(*, enabled: bool) -> ProgressDisplay:
    """A :class:`RichProgressDisplay` when ``enabled`` and stderr is a terminal, else a silent one."""
    if enabled and sys.stderr.isatty():
        return RichProgressDisplay()
    return ProgressDisplay()
