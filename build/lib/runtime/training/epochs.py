"""The data epochs as the loop reads them: a step's micro-batches (timed as data wait), whether
the reader has another epoch (waiting for it until a stop signal cuts the wait short), and the
start of the next one."""

from __future__ import annotations

import logging
import time
from typing import Generic, TypeVar, final

from runtime.data import DataReader, WaitInterrupted
from runtime.errors import TrainerError
from runtime.metrics.tracing import DATA_WAIT, RangeMaker
from runtime.metrics.train_metrics import TrainMetrics
from runtime.training.callbacks import CallbackList
from runtime.training.signals import StopSignals
from runtime.training.state import StopReason, TrainState

# The training's log lines share the Trainer's logger, the one name users filter on.
log = logging.getLogger(__name__)

BatchT = TypeVar("BatchT")


@final
class DataEpochs(Generic[BatchT]):
    """Reads the steps of ``data_reader`` epoch by epoch; ``state.data_epoch_nr`` counts them."""

    def __init__(
        self,
        *,
        data_reader: DataReader[BatchT],
        state: TrainState,
        metrics: TrainMetrics,
        callbacks: CallbackList,
        stop_signals: StopSignals,
        trace_range: RangeMaker,
    ) -> None:
        self._data_reader = data_reader
        self._state = state
        self._metrics = metrics
        self._callbacks = callbacks
        self._stop_signals = stop_signals
        self._range = trace_range
        # Whether the data epoch being read gave a batch; a resumed position may be at its end.
        self._had_batches = True

    def read_step(self) -> list[BatchT] | None:
        """The next step's micro-batches, or None at the end of the data epoch."""
        start = time.perf_counter()
        try:
            with self._range(DATA_WAIT):
                batches = next(self._data_reader)
        except StopIteration:
            return None
        finally:
            self._metrics.add_data_wait(time.perf_counter() - start)
        if not batches:
            raise TrainerError(
                f"The data reader returned no micro-batches for step {self._state.step_nr + 1}. "
                "Training readers must use SyncMode.UNTIL_FIRST."
            )
        self._had_batches = True
        return batches

    def end(self, *, max_num_data_epochs: int | None) -> StopReason | None:
        """End the data epoch being read (the callbacks' ``on_out_of_data``); return why the run
        stops here, if it does: the epoch limit, or a reader without another epoch (asked
        without waiting)."""
        state = self._state
        log.info("Data epoch %d ended at step %d.", state.data_epoch_nr, state.step_nr)
        self._callbacks.on_out_of_data(step_nr=state.step_nr, epoch_nr=state.data_epoch_nr)
        if max_num_data_epochs is not None and state.data_epoch_nr >= max_num_data_epochs:
            return StopReason.MAX_NUM_DATA_EPOCHS
        if not self._data_reader.has_next_epoch(wait=False):
            return StopReason.END_OF_DATA
        return None

    def wait_for_next(self) -> bool | None:
        """Whether the reader has another data epoch, waiting if it must; None when a stop signal
        cut the wait short."""
        try:
            return self._data_reader.has_next_epoch(stop_requested=self._stop_requested)
        except WaitInterrupted:
            log.warning(
                "Stopped waiting for data at step %d: a stop was requested.", self._state.step_nr
            )
            return None

    def _stop_requested(self) -> bool:
        return self._stop_signals.requested

    def check_had_batches(self) -> None:
        """An error if the epoch that just ended gave no batch: the next would give none either."""
        if not self._had_batches:
            raise TrainerError(
                f"The data reader ended epoch {self._state.data_epoch_nr} without a single batch. "
                "Check the dataset size against batch_size, num_accumulate and the DP gang."
            )

    def start_next(self) -> None:
        """Start the next data epoch (once :meth:`wait_for_next` said there is one)."""
        state = self._state
        state.data_epoch_nr += 1
        self._data_reader.reset()
        self._had_batches = False
        self._callbacks.on_epoch_begin(epoch_nr=state.data_epoch_nr, step_nr=state.step_nr)
