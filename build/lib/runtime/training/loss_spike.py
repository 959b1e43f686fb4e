"""Loss-spike rollback: notice a step whose loss jumps, go back to a checkpoint before it, and
train on past the data that made it.

Detection costs no host read of its own. The losses of a step stay on the device until the next
check of the metric window (at each publish and before each checkpoint), which reads them once
anyway for the non-finite check (:mod:`runtime.training.non_finite`). Each rank compares the
mean loss of each of its steps (its own share of the step: summed loss over its targets) with the
running median of its trailing ``window`` steps; the first spike step rides in the check's one
all-reduce, so every rank decides on the same step. A spike on one rank rolls every rank back.
``check_every_step`` moves the check to every step: one host read and one small all-reduce per
step, for a rollback that never trains past the spike.

A rollback from a spike at step ``s`` found at step ``d`` (see
:class:`runtime.training.rollback.LossSpikeRollback`): checkpoints from step ``s - lookback`` on
are marked unhealthy, every rank loads the newest healthy checkpoint ``c`` before that through
the resume path (model, optimizer, scheduler, RNG, loss scale, metric window, callbacks), and
the data reader keeps its position, reading and dropping on to step ``s + margin`` if that is
further. The run then goes on from step ``c`` exactly as a run whose data never held the
batches of steps ``c+1 .. max(d, s + margin)``. Policy, defaults and costs: docs/reliability.md.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, final

from runtime.errors import TrainerError
from trainkit_utils.arguments import check_positive


class LossSpikeError(TrainerError):
    """The run stopped on loss spikes: too many rollbacks in a window of steps, or a spike
    before the first checkpoint (nothing to roll back to)."""


@final
@dataclass(frozen=True, kw_only=True)
class LossSpikeGuard:
    """When a step is a spike, and what a rollback does (the Trainer's ``loss_spike_guard``).

    A step is a spike when its loss is NaN or infinite, when a gradient is, or, once ``window``
    steps are known (at least ``min_history``), when its loss exceeds ``factor`` times their
    median or their median plus ``num_deviations`` robust deviations (1.4826 times the median
    absolute deviation). Either threshold may be None (off).
    """

    window: int = 100
    """The trailing steps whose median the loss is compared with."""
    min_history: int = 20
    """Steps known before a finite loss can be a spike (the first steps of a run fall fast)."""
    factor: float | None = 3.0
    num_deviations: float | None = None
    margin: int = 0
    """Steps of data skipped beyond the spike step."""
    lookback: int = 0
    """Steps before the spike step where it may have begun (a loss creeping up before it
    jumps): the rollback goes to a checkpoint before them, and the checkpoints among them are
    marked unhealthy."""
    cool_lr_steps: int = 0
    """Steps after a rollback whose optimizer steps use the learning rate times
    ``cool_lr_factor`` (0: no cooling)."""
    cool_lr_factor: float = 0.1
    max_rollbacks: int = 3
    """Rollbacks allowed within ``rollback_window`` steps; one more spike stops the run."""
    rollback_window: int = 1000
    check_every_step: bool = False
    """Check after every step (one host read and one all-reduce per step) instead of at the
    publishes and checkpoints."""

    def __post_init__(self) -> None:
        check_positive("window", self.window)
        check_positive("min_history", self.min_history)
        check_positive("factor", self.factor)
        check_positive("num_deviations", self.num_deviations)
        check_positive("max_rollbacks", self.max_rollbacks)
        check_positive("rollback_window", self.rollback_window)
        if not 0.0 < self.cool_lr_factor <= 1.0:
            raise ValueError(
                f"cool_lr_factor must be in (0, 1], but is {self.cool_lr_factor} instead."
            )
        for name, value in (
            ("margin", self.margin),
            ("lookback", self.lookback),
            ("cool_lr_steps", self.cool_lr_steps),
        ):
            if value < 0:
                raise ValueError(f"{name} must be 0 or more, but is {value} instead.")
        if self.min_history > self.window:
            raise ValueError(
                f"min_history ({self.min_history}) must not exceed window ({self.window}): the "
                "window never holds more steps than that."
            )
        if self.factor is None and self.num_deviations is None:
            raise ValueError(
                "factor and num_deviations are both None, so no finite loss could be a spike. "
                "Set one of them."
            )


@final
@dataclass(frozen=True)
class Spike:
    """A spike the ranks agreed on: its step, and the loss and median of the rank that saw it
    (NaN for a non-finite gradient)."""

    step_nr: int
    loss: float
    median: float


@final
@dataclass(frozen=True)
class Rollback:
    """One rollback: from the spike step back to a checkpoint, with the steps whose data was
    skipped (``to_step + 1 .. skipped_until``)."""

    from_step: int
    to_step: int
    skipped_until: int
    loss: float
    median: float

    def describe(self) -> str:
        return (
            f"step {self.from_step} (loss {self.loss:.4g} against a median of {self.median:.4g}, "
            f"rolled back to step {self.to_step})"
        )


class LossSpikeDetected(Exception):
    """Raised by the window check on every rank alike; the loop rolls back on it."""

    def __init__(self, spike: Spike) -> None:
        super().__init__(f"A loss spike at step {spike.step_nr}.")
        self.spike = spike


@final
class SpikeDetector:
    """Keeps this rank's trailing step losses and finds the first spike among new steps.

    Its state (the trailing losses and the rollbacks of the run) is part of the trainer state;
    a rollback restores the trailing losses of the checkpoint and keeps the rollbacks.
    """

    def __init__(self, guard: LossSpikeGuard) -> None:
        self.guard = guard
        self._losses: deque[float] = deque(maxlen=guard.window)
        self.rollbacks: list[Rollback] = []

    def first_spike(self, step_losses: Sequence[tuple[int, float]]) -> tuple[int, float, float]:
        """The first of ``step_losses`` (step, this rank's mean loss) that is a spike, as (step,
        loss, median); the others join the trailing window. (-1, nan, nan) if none is."""
        guard = self.guard
        for step_nr, loss in step_losses:
            median = statistics.median(self._losses) if self._losses else math.nan
            if not math.isfinite(loss):
                return step_nr, loss, median
            if len(self._losses) >= guard.min_history and self._exceeds(loss, median):
                return step_nr, loss, median
            self._losses.append(loss)
        return -1, math.nan, math.nan

    def _exceeds(self, loss: float, median: float) -> bool:
        guard = self.guard
        if guard.factor is not None and loss > guard.factor * median:
            return True
        if guard.num_deviations is None:
            return False
        deviation = 1.4826 * statistics.median(abs(x - median) for x in self._losses)
        return loss > median + guard.num_deviations * deviation

    def lr_scale(self, step_nr: int) -> float:
        """The learning-rate factor of step ``step_nr``: ``cool_lr_factor`` within
        ``cool_lr_steps`` after the last rollback, else 1 (resumable: the rollbacks are state)."""
        guard = self.guard
        if not self.rollbacks or guard.cool_lr_steps == 0:
            return 1.0
        last = self.rollbacks[-1].to_step
        return guard.cool_lr_factor if last < step_nr <= last + guard.cool_lr_steps else 1.0

    def recent_rollbacks(self, step_nr: int) -> list[Rollback]:
        """The rollbacks from spikes within ``rollback_window`` steps before ``step_nr``."""
        start = step_nr - self.guard.rollback_window
        return [r for r in self.rollbacks if r.from_step > start]

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self._losses),
            "rollbacks": [asdict(r) for r in self.rollbacks],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._losses = deque((float(x) for x in state["losses"]), maxlen=self.guard.window)
        self.rollbacks = [Rollback(**r) for r in state["rollbacks"]]


def too_many_rollbacks(spike: Spike, recent: Sequence[Rollback], guard: LossSpikeGuard) -> str:
    """The message that stops a run whose spike at ``spike.step_nr`` is one too many."""
    listed = "; ".join(r.describe() for r in recent)
    return (
        f"Loss spike at step {spike.step_nr} (loss {spike.loss:.4g} against a running median of "
        f"{spike.median:.4g}) after {len(recent)} rollbacks within {guard.rollback_window} steps "
        f"(max_rollbacks is {guard.max_rollbacks}): {listed}. The training stopped; every "
        "checkpoint is kept. Lower the learning rate, check the data of these steps, or raise "
        "max_rollbacks."
    )
