"""The loop's side of the loss-spike guard (:mod:`runtime.training.loss_spike`): the cooled
learning rate after a rollback, the steps that check themselves, and the rollback.

A rollback reloads the newest healthy checkpoint before the spike through the resume path, keeps
the data reader where it is (reading and dropping on to the spike step plus the margin) and the
run's list of rollbacks, and tells the callbacks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, final

from checkpoint import LoadedCheckpoint
from runtime.data import DataReader
from runtime.training.callbacks import CallbackList
from runtime.training.checkpointer import Checkpointer
from runtime.training.loss_spike import (
    LossSpikeError,
    Rollback,
    Spike,
    SpikeDetector,
    too_many_rollbacks,
)
from runtime.training.schedule import Due
from runtime.training.state import TrainState
from runtime.training.step import TrainStep

LOSS_SPIKE_STATE = "runtime.loss_spike"
"""The name of the loss-spike guard's state (trailing losses, rollbacks) in the stateful section."""

# The training's log lines share the Trainer's logger, the one name users filter on.
log = logging.getLogger(__name__)


@final
class LossSpikeRollback:
    """Rolls the run back from the loss spikes that ``detector`` finds; ``reload`` loads the
    trainer state of a checkpoint into the loop (its resume path)."""

    def __init__(
        self,
        *,
        detector: SpikeDetector,
        state: TrainState,
        data_reader: DataReader[Any],
        train_step: TrainStep[Any],
        checkpointer: Checkpointer,
        callbacks: CallbackList,
        reload: Callable[[LoadedCheckpoint], None],
    ) -> None:
        self.detector = detector
        self._guard = detector.guard
        self._state = state
        self._data_reader = data_reader
        self._train_step = train_step
        self._checkpointer = checkpointer
        self._callbacks = callbacks
        self._reload = reload

    @property
    def num_rollbacks(self) -> int:
        return len(self.detector.rollbacks)

    def begin_step(self, step_nr: int) -> None:
        """Cool the learning rate of step ``step_nr`` if it follows a rollback closely."""
        self._train_step.lr_scale = self.detector.lr_scale(step_nr)

    def checks_after(self, due: Due) -> bool:
        """Whether the window is checked after this step itself: with ``check_every_step``, on
        the steps whose publish or checkpoint does not check anyway."""
        return self._guard.check_every_step and not (due.publish or due.checkpoint)

    def roll_back(self, spike: Spike) -> None:
        """Reload the newest healthy checkpoint before ``spike`` and move the data past it (plus
        the margin); or stop when the rollbacks are too many, or there is no checkpoint."""
        guard = self._guard
        recent = self.detector.recent_rollbacks(spike.step_nr)
        if len(recent) >= guard.max_rollbacks:
            raise LossSpikeError(too_many_rollbacks(spike, recent, guard))
        start = time.perf_counter()
        detected_at = self._state.step_nr
        self._checkpointer.finish_pending_save()
        loaded = self._checkpointer.load_before(max(spike.step_nr - guard.lookback, 1))
        if loaded is None:
            raise LossSpikeError(
                f"Loss spike at step {spike.step_nr} (loss {spike.loss:.4g} against a running "
                f"median of {spike.median:.4g}) before the first checkpoint, so there is "
                "nothing to roll back to. Checkpoint earlier (checkpoint_every_n_steps), or "
                "raise min_history of the loss-spike guard."
            )
        self._reload_keeping_the_data(loaded)
        to_step = loaded.step_nr
        # The steps since the checkpoint read the data up to the detection; it stays read, so a
        # second rollback to the same checkpoint never reads the data of the first again.
        skipped_until = detected_at + self._skip_data(spike.step_nr + guard.margin - detected_at)
        rollback = Rollback(spike.step_nr, to_step, skipped_until, spike.loss, spike.median)
        self.detector.rollbacks.append(rollback)
        log.warning(
            "Loss spike at step %d: loss %.4g against a running median %.4g; rolled back to "
            "step %d, skipping the data of steps %d..%d (%.2f s).",
            spike.step_nr, spike.loss, spike.median, to_step, to_step + 1, skipped_until,
            time.perf_counter() - start,
        )  # fmt: skip
        self._callbacks.on_rollback(from_step=spike.step_nr, to_step=to_step)

    def _reload_keeping_the_data(self, loaded: LoadedCheckpoint) -> None:
        """Load the trainer state of ``loaded``, all but the data position (and its epoch) and
        the rollbacks, which stay the run's."""
        reader_state = self._data_reader.state_dict()
        epoch_nr, rollbacks = self._state.data_epoch_nr, self.detector.rollbacks
        self._reload(loaded)
        self._data_reader.load_state_dict(reader_state)
        self._state.data_epoch_nr, self.detector.rollbacks = epoch_nr, rollbacks
        self._train_step.clear_non_finite()

    def _skip_data(self, num_steps: int) -> int:
        """Read and drop the micro-batches of ``num_steps`` steps (none if it is not positive),
        or fewer at the end of the data epoch (the reader then ends it at the next read); return
        how many."""
        num_steps = max(num_steps, 0)
        for skipped in range(num_steps):
            try:
                next(self._data_reader)
            except StopIteration:
                log.warning(
                    "The data epoch ended after skipping the data of %d steps of %d.",
                    skipped,
                    num_steps,
                )
                return skipped
        return num_steps
