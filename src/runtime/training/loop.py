"""The training loop of one launch: resume, steps and what falls due after them, the end.

Read :meth:`TrainLoop.run` top to bottom: it reads a step's micro-batches, takes the step, then
publishes, validates and checkpoints when their schedules say so. The end of a data epoch is an
event of the loop (:meth:`TrainLoop._end_data_epoch`), not a side effect of reading. Why the loop
stopped is one value, ``state.stop_reason``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, final

import torch

from checkpoint import CheckpointLayoutError
from checkpoint.arguments import check_positive
from gangs import Gangs
from runtime.data import DataReader
from runtime.errors import TrainerError
from runtime.metrics.profiler import TorchProfiler
from runtime.metrics.progress import ProgressDisplay
from runtime.metrics.recorders import MetricRecorder
from runtime.metrics.tracing import CHECKPOINT, DATA_WAIT, trace_range, traced
from runtime.metrics.train_metrics import TrainMetrics, describe_devices
from runtime.training.callbacks import CallbackList, overrides
from runtime.training.checkpointing import Checkpointer
from runtime.training.garbage_collection import GarbageCollection
from runtime.training.out_of_memory import MemoryFigures, step_out_of_memory_error
from runtime.training.rng import rng_state, seed_rngs, set_rng_state
from runtime.training.schedule import Schedule
from runtime.training.signals import StopSignals
from runtime.training.state import (
    TRAINER_STATE_VERSION,
    StopReason,
    TrainState,
    upgrade_trainer_state,
)
from runtime.training.step import TrainStep
from runtime.training.validation import Validator

# The training's log lines share the Trainer's logger, the one name users filter on.
log = logging.getLogger("runtime.training.trainer")

BatchT = TypeVar("BatchT")


@final
@dataclass(frozen=True)
class Schedules:
    publish: Schedule
    validate: Schedule
    checkpoint: Schedule
    validate_at_start: bool = False


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
@dataclass(frozen=True)
class Limits:
    max_num_steps: int | None
    max_num_data_epochs: int | None

    def __post_init__(self) -> None:
        check_positive("max_num_steps", self.max_num_steps)
        check_positive("max_num_data_epochs", self.max_num_data_epochs)


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
        garbage_collection: GarbageCollection,
    ) -> None:
        self.state = TrainState()
        self._data_reader = data_reader
        self._train_step = train_step
        self._metrics = metrics
        self._validator = validator
        self.checkpointer = checkpointer
        self._schedules = schedules
        self.limits = limits
        self.observers = observers
        self._gangs = gangs
        self._seed = seed
        self._callbacks = observers.callbacks
        # What runs after every step: only the callbacks that do something then, and the
        # progress display if it shows one.
        self._step_end_hooks = list(observers.callbacks.step_end_hooks)
        if overrides(observers.progress, ProgressDisplay, "advance"):
            self._step_end_hooks.insert(0, observers.progress.advance)
        self._recorder = observers.recorder
        self.stop_signals = StopSignals()
        self._profiler = observers.profiler
        self._trace = observers.profiler is not None
        self._next_batches = traced(DATA_WAIT, data_reader.__next__, enabled=self._trace)
        self._garbage_collection = garbage_collection
        self._run_start = time.perf_counter()
        # Whether the data epoch being read gave a batch; a resumed position may be at its end.
        self._epoch_had_batches = True

    # ----------------------------------------------------------------- resume

    def resume(self) -> None:
        """Seed this rank, then load the newest intact checkpoint if there is one.

        A fresh run (no checkpoint) starts from the Trainer's ``init_from`` weights, if given.
        """
        self._seed_rngs(step_nr=0)
        loaded = self.checkpointer.load_last()
        if loaded is None:
            self.checkpointer.load_initial_weights()
            return
        self.load_state_dict(loaded.trainer_state, resharded=loaded.resharded)
        log.info("Resumed from the checkpoint of step %d.", self.state.step_nr)
        reason = self.state.stop_reason
        if reason is not None and reason.is_limit and not self._limit_reached():
            log.info(
                "The run finished at step %d, but max_num_steps (%s) and max_num_data_epochs "
                "(%s) now allow more: training on.",
                self.state.step_nr,
                self.limits.max_num_steps,
                self.limits.max_num_data_epochs,
            )
            self.state.stop_reason = None

    def _limit_reached(self) -> bool:
        """Whether ``max_num_steps`` or ``max_num_data_epochs`` ends the training here."""
        max_steps, max_epochs = self.limits.max_num_steps, self.limits.max_num_data_epochs
        if max_steps is not None and self.state.step_nr >= max_steps:
            return True
        return (
            self.state.stop_reason is StopReason.MAX_NUM_DATA_EPOCHS
            and max_epochs is not None
            and self.state.data_epoch_nr >= max_epochs
        )

    def _seed_rngs(self, *, step_nr: int) -> None:
        dp = self._gangs.dp
        seed_rngs(self._seed, dp_rank=dp.rank, dp_size=dp.size, step_nr=step_nr)

    # -------------------------------------------------------------------- run

    def run(self) -> None:
        """Train until a stop reason; at the end of the run, finish it (not after a preemption)."""
        state = self.state
        self._callbacks.on_train_begin(step_nr=state.step_nr)
        if self._schedules.validate_at_start and state.step_nr == 0 and self._validator.has_units:
            self._validator.validate(0, baseline=True)

        log.info("Training from step %d on %s.", state.step_nr, describe_devices(self._gangs))
        self._run_start = time.perf_counter()
        self._metrics.restart_clock()
        max_steps = self.limits.max_num_steps
        if max_steps is not None and state.step_nr >= max_steps:
            state.stop_reason = StopReason.MAX_NUM_STEPS
        # The next step after which something falls due: between two such steps, a step only
        # compares its number with this one.
        due_step = self._next_due_step()
        with self._garbage_collection:
            while state.stop_reason is None:
                batches = self._read_step()
                if batches is None:
                    self._end_data_epoch()
                    continue
                due = state.step_nr + 1 >= due_step
                stop_requested = self._take_step(
                    batches, measure_grad_norm=due and self._measures_grad_norm(state.step_nr + 1)
                )
                if due or stop_requested:
                    self._after_step(stop_requested=stop_requested)
                    due_step = self._next_due_step()

        if state.stop_reason is StopReason.PREEMPTED:
            # The unpublished metric window is in the checkpoint, so after the resume the
            # published values are those of an uninterrupted run.
            log.warning("Stopped at step %d as requested by a signal.", state.step_nr)
        else:
            self._finish()

    def _next_due_step(self) -> int:
        """The next step after which :meth:`_after_step` has work: the first that a schedule,
        garbage collection or the step limit falls due after; with a profiler, every step
        (``sys.maxsize`` when nothing ever falls due)."""
        step_nr = self.state.step_nr
        if self._profiler is not None:
            return step_nr + 1
        schedules = self._schedules
        due_steps = [
            schedule.next_step_due(step_nr)
            for schedule in (
                schedules.publish,
                schedules.validate,
                schedules.checkpoint,
                self._garbage_collection.schedule,
            )
        ]
        due_steps.append(self.limits.max_num_steps)
        return min((due for due in due_steps if due is not None), default=sys.maxsize)

    def _measures_grad_norm(self, step_nr: int) -> bool:
        """Whether step ``step_nr`` measures the gradient norm: where it is published, that is
        on the publishing steps and on those after which the run may end (a validation may stop
        it early, and the end publishes what is left)."""
        schedules = self._schedules
        return (
            schedules.publish.due_after_step(step_nr)
            or schedules.validate.due_after_step(step_nr)
            or step_nr == self.limits.max_num_steps
        )

    def finish_pending_save(self) -> None:
        """Commit an asynchronous save still in flight (every rank must call it)."""
        self.checkpointer.finish_pending_save()

    def _read_step(self) -> list[BatchT] | None:
        """The next step's micro-batches, or None at the end of the data epoch."""
        start = time.perf_counter()
        try:
            batches = self._next_batches()
        except StopIteration:
            return None
        finally:
            self._metrics.add_data_wait(time.perf_counter() - start)
        if not batches:
            raise TrainerError(
                f"The data reader returned no micro-batches for step {self.state.step_nr + 1}. "
                "Training readers must use SyncMode.UNTIL_FIRST."
            )
        self._epoch_had_batches = True
        return batches

    def _take_step(self, batches: list[BatchT], *, measure_grad_norm: bool) -> bool:
        """Take one optimizer step; return whether any rank asked to stop."""
        self.state.step_nr += 1
        step_nr = self.state.step_nr
        try:
            output = self._train_step.take(
                batches,
                step_nr=step_nr,
                stop_requested=self.stop_signals.requested,
                measure_grad_norm=measure_grad_norm,
            )
        except torch.OutOfMemoryError as ex:
            device = self._gangs.root.device
            raise step_out_of_memory_error(
                step_nr, device=device, rank=self._gangs.root.rank, figures=MemoryFigures.of(device)
            ) from ex
        self._metrics.add_step(output)
        for hook in self._step_end_hooks:
            hook(step_nr=step_nr)
        return output.stop_requested

    def _after_step(self, *, stop_requested: bool) -> None:
        """Collect, publish, validate and checkpoint where due, and decide whether to stop."""
        state, schedules = self.state, self._schedules
        step_nr = state.step_nr
        self._garbage_collection.after_step(step_nr)
        if schedules.publish.due_after_step(step_nr):
            self._publish_train_metrics()
        early_stop = schedules.validate.due_after_step(step_nr) and self._validator.validate(
            step_nr
        )
        # Known before the save, so a checkpoint of the last step says the run is over.
        if early_stop:
            state.stop_reason = StopReason.EARLY_STOP
        elif step_nr == self.limits.max_num_steps:
            state.stop_reason = StopReason.MAX_NUM_STEPS
        elif stop_requested:
            state.stop_reason = StopReason.PREEMPTED
        if schedules.checkpoint.due_after_step(step_nr) or stop_requested:
            self._save_checkpoint()
        # A profiled step holds its own validation and checkpoint.
        if self._profiler is not None:
            self._profiler.step()

    def _end_data_epoch(self) -> None:
        """Validate and checkpoint on the data-epoch schedules; then stop or start the next epoch."""
        state = self.state
        log.info("Data epoch %d ended at step %d.", state.data_epoch_nr, state.step_nr)
        max_epochs = self.limits.max_num_data_epochs
        if max_epochs is not None and state.data_epoch_nr >= max_epochs:
            # The end of training validates and checkpoints this step.
            state.stop_reason = StopReason.MAX_NUM_DATA_EPOCHS
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
                and self.checkpointer.last_saved_step != state.step_nr
            ):
                self._save_checkpoint()
            if state.stop_reason is not None:
                return
        if not self._epoch_had_batches:
            raise TrainerError(
                f"The data reader ended epoch {state.data_epoch_nr} without a single batch. "
                "Check the dataset size against batch_size, num_accumulate and the DP gang."
            )
        state.data_epoch_nr += 1
        self._data_reader.reset()
        self._epoch_had_batches = False

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
        if self.checkpointer.last_saved_step != step_nr:
            self._save_checkpoint()
        log.info("Training finished at step %d.", step_nr)
        self._validator.log_best()

    # ------------------------------------------------------ publish and save

    def _publish_train_metrics(self) -> None:
        step_nr = self.state.step_nr
        extra = {
            "lr": self._train_step.learning_rate,
            "data_epoch": self.state.data_epoch_nr,
            "elapsed_time": time.perf_counter() - self._run_start,
        }
        loss_scale = self._train_step.loss_scale
        if loss_scale is not None:
            extra["loss_scale"] = loss_scale
        values = self._metrics.compute(extra)
        self._recorder.record("train", step_nr, values)
        self._callbacks.on_metrics_published(run="train", step_nr=step_nr, values=values)
        self.observers.progress.update_values(
            {k: float(v) for k, v in values.items() if k in ("loss", "lr", "grad_norm")}
        )

    def _save_checkpoint(self) -> None:
        # A checkpoint of weights a non-finite step poisoned would be resumed from; never save one.
        self._metrics.check_finite()
        step_nr = self.state.step_nr
        with trace_range(CHECKPOINT, self._trace):
            self.checkpointer.save(
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
        }

    def load_state_dict(self, state: Mapping[str, Any], *, resharded: bool = False) -> None:
        """Load this rank's trainer state, or rank 0's when the checkpoint was ``resharded``.

        After a reshard, what all ranks share (step, schedules, scores, loss scale) carries over
        and the data reader reshards its position; what is per rank cannot: the RNGs are seeded
        anew for this step, and the unpublished metric window starts empty.
        """
        state = upgrade_trainer_state(state)
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
