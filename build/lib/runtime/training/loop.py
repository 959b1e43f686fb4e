"""The training loop of one launch: resume, steps and what falls due after them, the end.

Read :meth:`TrainLoop.run` top to bottom: it reads a step's micro-batches, takes the step, then
publishes, validates and checkpoints when their schedules say so. The end of a data epoch is an
event of the loop (:meth:`TrainLoop._end_data_epoch`), not a side effect of reading. Why the loop
stopped is one value, ``state.stop_reason``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, final

import torch

from checkpoint import CheckpointLayoutError, LoadedCheckpoint
from gangs import Gangs
from runtime.data import DataReader
from runtime.errors import TrainerError
from runtime.metrics.profiler import TorchProfiler
from runtime.metrics.progress import ProgressDisplay
from runtime.metrics.recorders import MetricRecorder
from runtime.metrics.tracing import CHECKPOINT, trace_ranges
from runtime.metrics.train_metrics import TrainMetrics, describe_devices
from runtime.training.callbacks import CallbackList
from runtime.training.checkpointer import Checkpointer
from runtime.training.epochs import DataEpochs
from runtime.training.garbage_collection import GarbageCollection
from runtime.training.limits import Limits
from runtime.training.loss_spike import LossSpikeDetected, SpikeDetector
from runtime.training.out_of_memory import MemoryFigures, step_out_of_memory_error
from runtime.training.relaunch import reopen_finished_run
from runtime.training.rng import rng_state, seed_rngs, set_rng_state
from runtime.training.rollback import LOSS_SPIKE_STATE, LossSpikeRollback
from runtime.training.schedule import Due, Schedules
from runtime.training.signals import StopSignals
from runtime.training.state import (
    STATEFUL_SECTION,
    TRAINER_STATE_VERSION,
    Stateful,
    StopReason,
    TrainState,
    check_trainer_state,
    load_stateful,
    save_stateful,
)
from runtime.training.step import TrainStep
from runtime.training.validation import Validator

log = logging.getLogger(__name__)

BatchT = TypeVar("BatchT")


@final
@dataclass(frozen=True)
class Observers:
    """Who watches the loop: the callbacks, the metric recorder, the progress display, the
    profiler."""

    callbacks: CallbackList
    recorder: MetricRecorder
    progress: ProgressDisplay
    profiler: TorchProfiler | None = None


@final
class TrainLoop(Generic[BatchT]):
    """Trains from the last checkpoint until a stop reason; every rank runs the same loop."""

    def __init__(
        self,
        *,
        data_reader: DataReader[BatchT],
        train_step: TrainStep[BatchT],
        metrics: TrainMetrics,
        validator: Validator,
        checkpointer: Checkpointer,
        schedules: Schedules,
        limits: Limits,
        observers: Observers,
        gangs: Gangs,
        seed: int,
        spikes: SpikeDetector | None = None,
    ) -> None:
        self.state = TrainState()
        self._data_reader = data_reader
        self._train_step = train_step
        self._metrics = metrics
        self._validator = validator
        self._checkpointer = checkpointer
        self._schedules = schedules
        self._limits = limits
        self._gangs = gangs
        self._seed = seed
        self._callbacks = observers.callbacks
        self.stateful: dict[str, Stateful] = {}
        """Objects the user registered (``Trainer.register_stateful``), saved with the state."""
        self._recorder = observers.recorder
        self._progress: ProgressDisplay = observers.progress
        self._profiler = observers.profiler
        self.stop_signals = StopSignals()
        self._range = trace_ranges(observers.profiler is not None)
        self._epochs = DataEpochs(
            data_reader=data_reader,
            state=self.state,
            metrics=metrics,
            callbacks=self._callbacks,
            stop_signals=self.stop_signals,
            trace_range=self._range,
        )
        self._run_start = time.perf_counter()
        self._rollback: LossSpikeRollback | None = None
        if spikes is not None:
            self._rollback = LossSpikeRollback(
                detector=spikes,
                state=self.state,
                data_reader=data_reader,
                train_step=train_step,
                checkpointer=checkpointer,
                callbacks=self._callbacks,
                reload=self._load_checkpoint_state,
            )

    # ----------------------------------------------------------------- resume

    def resume(self) -> None:
        """Seed this rank, then load the newest intact checkpoint if there is one.

        A fresh run (no checkpoint) starts from the Trainer's ``init_from`` weights, if given.
        A run whose checkpoints leave entries out (``checkpoint_exclude``) loads ``init_from``
        under every checkpoint too: the entries left out come back from where they started (the
        frozen base of a LoRA run, say).
        """
        self._seed_rngs(step_nr=0)
        reloads_initial_weights = bool(self._checkpointer.options.exclude)
        if reloads_initial_weights:
            self._checkpointer.load_initial_weights()
        loaded = self._checkpointer.load_last()
        if loaded is None:
            if not reloads_initial_weights:
                self._checkpointer.load_initial_weights()
            return
        self._load_checkpoint_state(loaded)
        log.info("Resumed from the checkpoint of step %d.", self.state.step_nr)
        reopen_finished_run(self.state, self._limits, self._epochs.wait_for_next)

    def _seed_rngs(self, *, step_nr: int) -> None:
        dp = self._gangs.dp
        seed_rngs(self._seed, dp_rank=dp.rank, dp_size=dp.size, step_nr=step_nr)

    # -------------------------------------------------------------------- run

    def run(self) -> None:
        """Train until a stop reason; at the end of the run, finish it (not after a preemption).

        An asynchronous save of the last step commits before this returns; after an exception
        it never does.
        """
        with contextlib.ExitStack() as stack:
            if self._profiler is not None:
                stack.enter_context(self._profiler)
            self._begin()
            with GarbageCollection(scheduled=self._schedules.collect_garbage.is_set):
                self._train_until_stop()
            if self.state.stop_reason is StopReason.PREEMPTED:
                # The unpublished metric window is in the checkpoint, so after the resume the
                # published values are those of an uninterrupted run.
                log.warning("Stopped at step %d as requested by a signal.", self.state.step_nr)
            else:
                self._finish()
            self._checkpointer.finish_pending_save()

    def _begin(self) -> None:
        state = self.state
        self._progress.start(total_steps=self._limits.max_num_steps, initial_step=state.step_nr)
        self._callbacks.on_train_begin(step_nr=state.step_nr)
        if state.step_nr == 0:
            has_first = self._epochs.wait_for_next()
            if has_first is None:
                state.stop_reason = StopReason.PREEMPTED
                return
            if not has_first:
                raise TrainerError(
                    "The data reader has no data to train on: its has_next_epoch() is False "
                    "before the first data epoch."
                )
            self._callbacks.on_epoch_begin(epoch_nr=state.data_epoch_nr, step_nr=0)
        if self._schedules.validate_at_start and state.step_nr == 0 and self._validator.has_units:
            self._validator.validate(0, baseline=True)
        log.info("Training from step %d on %s.", state.step_nr, describe_devices(self._gangs))
        self._run_start = time.perf_counter()
        self._metrics.restart_clock()
        max_steps = self._limits.max_num_steps
        if max_steps is not None and state.step_nr >= max_steps:
            state.stop_reason = StopReason.MAX_NUM_STEPS

    def _train_until_stop(self) -> None:
        """Train step by step until a stop reason; a loss spike rolls back and trains on."""
        while self.state.stop_reason is None:
            try:
                self._train_one_step()
            except LossSpikeDetected as detected:
                assert self._rollback is not None
                self._rollback.roll_back(detected.spike)

    def _train_one_step(self) -> None:
        """Read, step, and do what falls due after the step (or end the data epoch)."""
        state = self.state
        batches = self._epochs.read_step()
        if batches is None:
            self._end_data_epoch()
        else:
            due = self._schedules.due_after_step(state.step_nr + 1)
            stop_requested = self._take_step(batches, due)
            if self._rollback is not None and self._rollback.checks_after(due):
                self._metrics.check_finite()
            self._after_step(due, stop_requested=stop_requested)
        if self._rollback is not None and state.stop_reason is not None:
            # A spike among the steps not checked yet rolls back before the run ends.
            self._metrics.check_finite()

    def _take_step(self, batches: list[BatchT], due: Due) -> bool:
        """Take one optimizer step; return whether any rank asked to stop."""
        self.state.step_nr += 1
        step_nr = self.state.step_nr
        self._callbacks.on_step_begin(step_nr=step_nr, batches=batches)
        if self._rollback is not None:
            self._rollback.begin_step(step_nr)
        try:
            # The gradient norm is measured where it is published: on the publishing steps and
            # on those after which the run may end (a validation may stop it early, and the end
            # publishes what is left).
            output = self._train_step(
                batches,
                step_nr=step_nr,
                stop_requested=self.stop_signals.requested,
                measure_grad_norm=(
                    due.publish or due.validate or step_nr == self._limits.max_num_steps
                ),
            )
        except torch.OutOfMemoryError as ex:
            device = self._gangs.root.device
            raise step_out_of_memory_error(
                step_nr, device=device, rank=self._gangs.root.rank, figures=MemoryFigures.of(device)
            ) from ex
        self._metrics.add_step(output)
        self._progress.advance(step_nr=step_nr)
        return output.stop_requested

    def _after_step(self, due: Due, *, stop_requested: bool) -> None:
        """Collect, publish, validate and checkpoint where due, and decide whether to stop."""
        state = self.state
        step_nr = state.step_nr
        values = self._publish_train_metrics() if due.publish else None
        self._callbacks.on_step_end(step_nr=step_nr, metrics=values)
        # After the step's callbacks, as a collection between steps.
        if due.collect_garbage:
            gc.collect()
        early_stop = due.validate and self._validator.validate(step_nr)
        # Known before the save, so a checkpoint of the last step says the run is over.
        if early_stop:
            state.stop_reason = StopReason.EARLY_STOP
        elif step_nr == self._limits.max_num_steps:
            state.stop_reason = StopReason.MAX_NUM_STEPS
        elif stop_requested:
            state.stop_reason = StopReason.PREEMPTED
        if due.checkpoint or stop_requested:
            self._save_checkpoint()
        # A profiled step holds its own validation and checkpoint.
        if self._profiler is not None:
            self._profiler.step()

    def _end_data_epoch(self) -> None:
        """Validate and checkpoint on the data-epoch schedules; then stop or start the next epoch."""
        state = self.state
        state.stop_reason = self._epochs.end(max_num_data_epochs=self._limits.max_num_data_epochs)
        if state.stop_reason is not None:
            # Known before the save, so the end of training validates and checkpoints this step
            # with a checkpoint that says the run is over.
            self._callbacks.on_epoch_end(epoch_nr=state.data_epoch_nr, step_nr=state.step_nr)
            return
        if state.step_nr > 0:
            if (
                self._schedules.validate.due_after_data_epoch(state.data_epoch_nr)
                and self._validator.last_validated_step != state.step_nr
                and self._validator.validate(state.step_nr)
            ):
                state.stop_reason = StopReason.EARLY_STOP
            if (
                self._schedules.checkpoint.due_after_data_epoch(state.data_epoch_nr)
                and self._checkpointer.last_saved_step != state.step_nr
            ):
                self._save_checkpoint()
        self._callbacks.on_epoch_end(epoch_nr=state.data_epoch_nr, step_nr=state.step_nr)
        if state.stop_reason is not None:
            return
        self._epochs.check_had_batches()
        self._start_next_data_epoch()

    def _start_next_data_epoch(self) -> None:
        """Start the reader's next data epoch once it has one (after the epoch's checkpoint, so
        a long wait for data holds nothing unsaved); or stop: the data ended, or a stop signal
        cut the wait short."""
        state = self.state
        has_next = self._epochs.wait_for_next()
        if has_next is None:
            state.stop_reason = StopReason.PREEMPTED
            if self._checkpointer.last_saved_step != state.step_nr:
                self._save_checkpoint()
            return
        if not has_next:
            log.info("The data ended after data epoch %d.", state.data_epoch_nr)
            state.stop_reason = StopReason.END_OF_DATA
            return
        self._epochs.start_next()

    def _finish(self) -> None:
        """Publish, validate and checkpoint what the last step left undone."""
        step_nr = self.state.step_nr
        if self._metrics.num_steps > 0:
            self._publish_train_metrics()
        if (
            self._validator.has_units
            and self._validator.last_validated_step != step_nr
            and self._validator.validate(step_nr)
        ):
            self.state.stop_reason = StopReason.EARLY_STOP
        if self._checkpointer.last_saved_step != step_nr:
            self._save_checkpoint()
        log.info("Training finished at step %d.", step_nr)
        self._validator.log_best()

    # ------------------------------------------------------ publish and save

    def _publish_train_metrics(self) -> dict[str, Any]:
        step_nr = self.state.step_nr
        extra: dict[str, float] = {
            **self._train_step.learning_rates(),
            "data_epoch": self.state.data_epoch_nr,
            "elapsed_time": time.perf_counter() - self._run_start,
        }
        loss_scale = self._train_step.loss_scale
        if loss_scale is not None:
            extra["loss_scale"] = loss_scale
        if self._rollback is not None:
            extra["num_rollbacks"] = self._rollback.num_rollbacks
        values = self._metrics.compute(extra)
        self._recorder.record("train", step_nr, values)
        self._callbacks.on_metrics_published(run="train", step_nr=step_nr, values=values)
        self._progress.update_values(
            {k: float(v) for k, v in values.items() if k in ("loss", "lr", "grad_norm")}
        )
        return values

    def _save_checkpoint(self) -> None:
        # A checkpoint of weights a non-finite step poisoned would be resumed from; never save one.
        self._metrics.check_finite()
        step_nr = self.state.step_nr
        with self._range(CHECKPOINT):
            self._checkpointer.save(
                step_nr, trainer_state=self.state_dict(), score=self._validator.score_at(step_nr)
            )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's trainer state, as ``trainer/rank_R.pt`` of a checkpoint holds it."""
        return {
            "version": TRAINER_STATE_VERSION,
            "train_state": self.state.state_dict(),
            "data_reader": self._data_reader.state_dict(),
            "rng": rng_state(),
            "train_step": self._train_step.state_dict(),
            "train_metrics": self._metrics.state_dict(),
            "validation": self._validator.state_dict(),
            **save_stateful(self._all_stateful()),
        }

    def _all_stateful(self) -> dict[str, Stateful]:
        runtime: dict[str, Stateful] = {}
        if self._rollback is not None:
            runtime[LOSS_SPIKE_STATE] = self._rollback.detector
        return {**self._callbacks.stateful(), **self.stateful, **runtime}

    def _load_checkpoint_state(self, loaded: LoadedCheckpoint) -> None:
        self.load_state_dict(loaded.trainer_state, resharded=loaded.resharded)

    def load_state_dict(self, state: Mapping[str, Any], *, resharded: bool = False) -> None:
        """Load this rank's trainer state, or rank 0's when the checkpoint was ``resharded``.

        After a reshard, what all ranks share (step, schedules, scores, loss scale) carries over
        and the data reader reshards its position; what is per rank cannot: the RNGs are seeded
        anew for this step, and the unpublished metric window starts empty.
        """
        state = check_trainer_state(state)
        self.state.load_state_dict(state["train_state"])
        if resharded:
            try:
                self._data_reader.load_state_dict(state["data_reader"])
            except ValueError as ex:
                raise CheckpointLayoutError(str(ex)) from ex
            self._seed_rngs(step_nr=self.state.step_nr)
            log.warning(
                "Resumed from another world layout: the data position was resharded and the "
                "RNGs seeded anew, so the run is no longer bit-identical to an uninterrupted one, "
                "and the first train metrics published cover only the steps after step %d.",
                self.state.step_nr,
            )
        else:
            self._data_reader.load_state_dict(state["data_reader"])
            set_rng_state(state["rng"])
            self._metrics.load_state_dict(state["train_metrics"])
        self._train_step.load_state_dict(state["train_step"])
        self._validator.load_state_dict(state["validation"])
        load_stateful(self._all_stateful(), state.get(STATEFUL_SECTION, {}))
