"""The Trainer: turns its arguments into the parts of a training run, and runs it.

The parts, each in its own module: :class:`~runtime.training.step.TrainStep` (one optimizer step),
:class:`~runtime.training.loop.TrainLoop` (the loop and the stop decision),
:class:`~runtime.training.validation.Validator`, :class:`~runtime.training.checkpointer.Checkpointer`,
:class:`~runtime.metrics.train_metrics.TrainMetrics` and the schedules that say when each is due.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, final

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from checkpoint import AbstractCheckpointManager, CheckpointChoice, RetentionPolicy
from gangs import Gang, Gangs
from runtime.data import DataReader
from runtime.data.device import DeviceDataReader
from runtime.metrics.device_peaks import compute_dtype
from runtime.metrics.profiler import TorchProfiler
from runtime.metrics.progress import make_progress_display
from runtime.metrics.recorders import MetricRecorder, RecorderOptions, make_recorder
from runtime.metrics.train_metrics import Throughput, TrainMetrics
from runtime.parallel.placement import check_model_device
from runtime.training.callbacks import CallbackList
from runtime.training.checkpointer import Checkpointer, CheckpointOptions
from runtime.training.early_stop import EarlyStopper
from runtime.training.limits import Limits
from runtime.training.loop import Observers, TrainLoop
from runtime.training.loss_spike import LossSpikeGuard, SpikeDetector
from runtime.training.non_finite import NanPolicy
from runtime.training.rollback import LOSS_SPIKE_STATE
from runtime.training.schedule import (
    Schedule,
    Schedules,
    check_every_checkpoint_is_scored,
    check_snapshots_are_saved,
)
from runtime.training.signals import PREEMPTED_EXIT_CODE
from runtime.training.state import Stateful, StopReason
from runtime.training.step import Precision, TrainStep
from runtime.training.validation import Scoring, Validator
from units import EvalUnit, TrainUnit
from units.callback import TrainerCallback

log = logging.getLogger(__name__)

BatchT = TypeVar("BatchT")

if TYPE_CHECKING:
    from runtime.parallel.pipeline import Pipeline
    from runtime.training.initial_weights import InitFrom


@final
class Trainer(Generic[BatchT]):
    """Trains ``unit`` on the batches of ``data_reader``; resumes from the last checkpoint.

    Each step takes ``data_reader.num_accumulate`` micro-batches, backpropagates the unit's summed
    loss of each, and scales the gradients so the update is the mean over all targets of the
    step, across gradient accumulation and the data-parallel gang.
    """

    def __init__(
        self,
        *,
        unit: TrainUnit[BatchT],
        data_reader: DataReader[BatchT],
        optimizer: Optimizer | Sequence[Optimizer],
        checkpoint_manager: AbstractCheckpointManager,
        root_gang: Gang | None = None,
        dp_gang: Gang | None = None,
        tp_gang: Gang | None = None,
        gangs: Gangs | None = None,
        dtype: torch.dtype = torch.float32,
        lr_scheduler: LRScheduler | Sequence[LRScheduler] | None = None,
        max_num_steps: int | None = None,
        max_num_data_epochs: int | None = None,
        valid_units: Sequence[EvalUnit[Any]] | None = None,
        valid_data_readers: Sequence[DataReader[Any]] | None = None,
        max_num_valid_steps: int | None = None,
        validate_every_n_steps: int | None = None,
        validate_after_n_steps: int = 0,
        validate_every_n_data_epochs: int | None = None,
        validate_at_start: bool = False,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_after_n_steps: int = 0,
        checkpoint_every_n_data_epochs: int | None = None,
        keep_last_n_checkpoints: int | None = None,
        keep_best_n_checkpoints: int | None = None,
        keep_last_n_models: int | None = None,
        keep_best_n_models: int | None = None,
        keep_checkpoint_every_n_steps: int | None = None,
        async_checkpoint: bool = False,
        reshard_on_resume: bool = False,
        score_metric_name: str | None = None,
        lower_better: bool = False,
        early_stopper: EarlyStopper | None = None,
        publish_metrics_every_n_steps: int | None = None,
        tb_dir: Path | None = None,
        metrics_dir: Path | None = None,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        wandb_dir: Path | None = None,
        wandb_config: Mapping[str, object] | None = None,
        recorders: Sequence[MetricRecorder] = (),
        fp16_loss_scale: tuple[float, float] = (128.0, 0.0001),
        max_gradient_norm: float | None = None,
        amp: bool = False,
        anomaly_detection: bool = False,
        profiler: TorchProfiler | None = None,
        seed: int = 2,
        callbacks: Sequence[TrainerCallback] = (),
        progress: bool = True,
        nan_policy: NanPolicy = "error",
        max_consecutive_skipped_steps: int = 10,
        gc_every_n_steps: int | None = None,
        flops_per_target: float | None = None,
        device_peak_flops: float | None = None,
        init_from: InitFrom | None = None,
        move_batches_to_device: bool = True,
        resume_from: Path | None = None,
        checkpoint_exclude: Sequence[str] = (),
        loss_spike_guard: LossSpikeGuard | None = None,
        pipeline: Pipeline | None = None,
    ) -> None:
        gangs = _resolve_gangs(gangs, root_gang, dp_gang, tp_gang)
        valid_units = _prepare_units(unit, valid_units, pipeline, gangs)
        # The keywords above, each turned into the option group that uses it; from here on only
        # the groups travel.
        schedules = _schedules(
            publish_every=publish_metrics_every_n_steps, gc_every=gc_every_n_steps,
            validate=(validate_every_n_steps, validate_after_n_steps, validate_every_n_data_epochs),
            checkpoint=(
                checkpoint_every_n_steps, checkpoint_after_n_steps, checkpoint_every_n_data_epochs
            ),
            validate_at_start=validate_at_start,
        )  # fmt: skip
        scoring = Scoring(score_metric_name, lower_better, early_stopper)
        retention = RetentionPolicy(
            keep_last_n_checkpoints, keep_best_n_checkpoints, keep_last_n_models,
            keep_best_n_models, keep_checkpoint_every_n_steps,
        )  # fmt: skip
        checkpointing = CheckpointOptions(
            retention, async_checkpoint, reshard_on_resume, init_from, resume_from,
            tuple(checkpoint_exclude),
        )  # fmt: skip
        recording = RecorderOptions(
            tb_dir, metrics_dir, wandb_project, wandb_run_name, wandb_dir, wandb_config
        )
        _check_validation(valid_units, schedules, retention, scoring)
        self._unit, self._gangs, self._anomaly_detection = unit, gangs, anomaly_detection
        self._callbacks = CallbackList(callbacks)
        self._checkpoint_manager, self._scoring = checkpoint_manager, scoring
        precision = Precision(dtype, amp, fp16_loss_scale)
        batch_device = gangs.root.device if move_batches_to_device else None
        data_reader, valid_data_readers = self._take_readers(
            data_reader, valid_data_readers, batch_device
        )
        self._closed = False
        self._train_step = _make_train_step(
            pipeline,
            unit=unit,
            optimizer=optimizer,
            gangs=gangs,
            lr_scheduler=lr_scheduler,
            precision=precision,
            max_gradient_norm=max_gradient_norm,
            nan_policy=nan_policy,
            max_consecutive_skipped_steps=max_consecutive_skipped_steps,
            trace=profiler is not None,
            callbacks=self._callbacks,
        )
        self._recorder = make_recorder(gangs.root, recorders, recording)
        self._progress = make_progress_display(enabled=progress and gangs.root.rank == 0)
        self._validator = self._make_validator(valid_units, valid_data_readers, max_num_valid_steps)
        self._checkpointer = self._make_checkpointer(self._train_step.optimizers, checkpointing)
        metrics = self._make_metrics(
            _throughput(unit, gangs, flops_per_target, device_peak_flops, precision)
        )
        spikes = _spike_detector(loss_spike_guard, checkpoint_every_n_steps)
        self._train_step.guard.spikes = spikes
        limits = Limits(max_num_steps, max_num_data_epochs)
        self._loop = self._make_loop(
            data_reader, metrics, schedules, limits, profiler, seed, spikes
        )

    def _make_loop(
        self,
        data_reader: DataReader[BatchT],
        metrics: TrainMetrics,
        schedules: Schedules,
        limits: Limits,
        profiler: TorchProfiler | None,
        seed: int,
        spikes: SpikeDetector | None,
    ) -> TrainLoop[BatchT]:
        return TrainLoop(
            data_reader=data_reader,
            train_step=self._train_step,
            metrics=metrics,
            validator=self._validator,
            checkpointer=self._checkpointer,
            schedules=schedules,
            limits=limits,
            observers=Observers(self._callbacks, self._recorder, self._progress, profiler),
            gangs=self._gangs,
            seed=seed,
            spikes=spikes,
        )

    def _take_readers(
        self,
        data_reader: DataReader[BatchT],
        valid_data_readers: Sequence[DataReader[Any]] | None,
        device: torch.device | None,
    ) -> tuple[DataReader[BatchT], list[DataReader[Any]]]:
        """The readers as the loop reads them (see :func:`_prepare_readers`); all of them, the
        given ones too, are closed by :meth:`close`."""
        given = [data_reader, *(valid_data_readers or [])]
        data_reader, valid = _prepare_readers(data_reader, valid_data_readers, device)
        self._data_readers = list({id(r): r for r in [*given, data_reader, *valid]}.values())
        return data_reader, valid

    def _make_checkpointer(
        self, optimizers: Sequence[Optimizer], checkpointing: CheckpointOptions
    ) -> Checkpointer:
        return Checkpointer(
            manager=self._checkpoint_manager,
            options=checkpointing,
            scoring=self._scoring,
            model=self._unit.model,
            # One optimizer is handed over alone, as the checkpoint managers written for one
            # optimizer expect.
            optimizer=optimizers[0] if len(optimizers) == 1 else optimizers,
            callbacks=self._callbacks,
            gangs=self._gangs,
        )

    def _make_metrics(self, throughput: Throughput) -> TrainMetrics:
        return TrainMetrics(
            unit_metrics=self._unit.metric_bag,
            gangs=self._gangs,
            guard=self._train_step.guard,
            throughput=throughput,
        )

    def _make_validator(
        self,
        valid_units: Sequence[EvalUnit[Any]] | None,
        valid_data_readers: Sequence[DataReader[Any]] | None,
        max_num_valid_steps: int | None,
    ) -> Validator:
        return Validator(
            units=list(valid_units or []),
            data_readers=list(valid_data_readers or []),
            model=self._unit.model,
            gangs=self._gangs,
            recorder=self._recorder,
            autocast=self._train_step.autocast,
            scoring=self._scoring,
            callbacks=self._callbacks,
            trace=self._train_step.traces,
            max_num_steps=max_num_valid_steps,
        )

    @property
    def step_nr(self) -> int:
        return self._loop.state.step_nr

    def add_callback(self, callback: TrainerCallback) -> None:
        """Add ``callback`` after those given to the constructor (before :meth:`run`)."""
        self._callbacks.add(callback)

    def register_stateful(self, name: str, obj: Stateful) -> None:
        """Save ``obj.state_dict()`` under ``name`` with the trainer state of every checkpoint,
        and restore it with ``obj.load_state_dict`` on resume (before :meth:`run`)."""
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"{name} must have state_dict() and load_state_dict(), but "
                f"{type(obj).__name__} lacks them."
            )
        if name in self._loop.stateful or name.startswith("callbacks.") or name == LOSS_SPIKE_STATE:
            raise ValueError(
                f"The name {name!r} is taken (names starting with 'callbacks.' are the stateful "
                f"callbacks', {LOSS_SPIKE_STATE!r} the loss-spike guard's). Register each object "
                "under a name of its own."
            )
        self._loop.stateful[name] = obj

    @property
    def resume_from(self) -> Path | None:
        """The ``step_N`` checkpoint directory of another run this run starts from, if any."""
        return self._checkpointer.options.resume_from

    @resume_from.setter
    def resume_from(self, path: Path | None) -> None:
        # The recipe command line sets it on the trainer a recipe built (``--resume-from``).
        self._checkpointer.options = dataclasses.replace(
            self._checkpointer.options, resume_from=path
        )

    @property
    def gangs(self) -> Gangs:
        return self._gangs

    @property
    def stop_requested(self) -> bool:
        """Whether a SIGTERM or SIGUSR1 arrived; the next step boundary stops every rank."""
        return self._loop.stop_signals.requested

    def run(self) -> int:
        """Train until a stop condition; return the process exit status (0 when finished).

        A run stopped by SIGTERM or SIGUSR1 returns :data:`PREEMPTED_EXIT_CODE` after saving a
        checkpoint at the step all ranks agreed on.
        """
        with contextlib.ExitStack() as stack:
            stack.callback(self.close)
            if self._anomaly_detection:
                stack.enter_context(torch.autograd.detect_anomaly())
            stack.enter_context(self._loop.stop_signals)

            self._loop.resume()
            state = self._loop.state
            if state.finished:
                log.info("The run finished at step %d already; nothing to do.", state.step_nr)
                return 0

            self._unit.model.train()
            self._loop.run()
            if state.finished:
                self._callbacks.on_train_end(step_nr=state.step_nr)
        return PREEMPTED_EXIT_CODE if state.stop_reason is StopReason.PREEMPTED else 0

    def evaluate_checkpoint(self, which: CheckpointChoice = "last") -> dict[str, dict[str, Any]]:
        """Load the model of a checkpoint and run the valid units on it, published as ``eval``.

        ``which`` is ``"last"``, ``"best"`` (by the score stored with each checkpoint, oriented
        by ``lower_better``) or a step number. The values are recorded at the checkpoint's step
        under the run ``eval`` (``eval/<display_name>`` for named units), with the same metric
        names as ``valid``, and returned by run name. The trainer is closed afterwards: one used
        for this is not meant to ``run()`` too.
        """
        evaluator = self._validator.evaluator(run_prefix="eval")
        try:
            if self._checkpointer.options.exclude:
                # What the checkpoints leave out comes from init_from, as on resume.
                self._checkpointer.load_initial_weights()
            return evaluator.evaluate_checkpoint(
                self._checkpoint_manager, which, lower_better=self._scoring.lower_better
            )
        finally:
            self.close()

    def close(self) -> None:
        """Release what the training holds: the recorders' files, the progress display, the
        checkpoint manager's background work (an uncommitted save stays uncommitted) and the
        data readers' threads. :meth:`run` calls it on every exit; a second call does nothing.
        Each part is closed even if closing another fails."""
        if self._closed:
            return
        self._closed = True
        with contextlib.ExitStack() as stack:
            for reader in self._data_readers:
                stack.callback(reader.close)
            stack.callback(self._progress.close)
            stack.callback(self._checkpoint_manager.close)
            stack.callback(self._recorder.close)


def _make_train_step(pipeline: Pipeline | None, **kwargs: Any) -> TrainStep[Any]:
    """The step: :class:`TrainStep`, or under pipeline parallelism (``gangs.pp.size > 1``) the
    :class:`~runtime.training.pipeline_step.PipelineTrainStep` over ``pipeline``."""
    if pipeline is None:
        return TrainStep(**kwargs)
    from runtime.training.pipeline_step import PipelineTrainStep

    return PipelineTrainStep(pipeline=pipeline, **kwargs)


def _prepare_units(
    unit: TrainUnit[Any],
    valid_units: Sequence[EvalUnit[Any]] | None,
    pipeline: Pipeline | None,
    gangs: Gangs,
) -> Sequence[EvalUnit[Any]] | None:
    """Place the units (:func:`_place_units`) and return the valid units as the Validator runs
    them: under pipeline parallelism each through the pipeline (forward only). A pipeline comes
    with a PP gang, and a PP gang with a pipeline."""
    _place_units(unit, valid_units or (), gangs.root.device)
    if (pipeline is None) != (gangs.pp.size == 1):
        raise ValueError(
            f"pipeline must be given exactly when the gangs have a PP gang (gangs.pp.size is "
            f"{gangs.pp.size}, pipeline is {'not ' if pipeline is None else ''}given). Build "
            "it with runtime.parallel.pipeline.Pipeline over setup_gangs(pp_size=...)."
        )
    if pipeline is None or not valid_units:
        return valid_units
    from runtime.training.pipeline_step import PipelineEvalUnit

    return [PipelineEvalUnit(unit, pipeline, gangs.pp) for unit in valid_units]


def _place_units(
    unit: TrainUnit[Any], valid_units: Sequence[EvalUnit[Any]], device: torch.device
) -> None:
    """Check that the model is on the gangs' ``device``, and move the units' metric bags there:
    units update their metrics with the losses they compute, on that device."""
    check_model_device(unit.model, device)
    for bag in (unit.metric_bag, *(u.metric_bag for u in valid_units)):
        bag.to(device)


def _throughput(
    unit: TrainUnit[Any],
    gangs: Gangs,
    flops_per_target: float | None,
    device_peak_flops: float | None,
    precision: Precision,
) -> Throughput:
    device = gangs.root.device
    # numel() of a DTensor (FSDP2, TP) is that of the whole parameter, not of this rank's shard.
    return Throughput.for_device(
        flops_per_target,
        device_peak_flops,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        num_parameters=sum(p.numel() for p in unit.model.parameters()),
        compute_dtype=compute_dtype(
            unit.model, autocast_dtype=precision.dtype if precision.amp else None
        ),
    )


def _schedules(
    *,
    publish_every: int | None,
    validate: tuple[int | None, int, int | None],
    checkpoint: tuple[int | None, int, int | None],
    gc_every: int | None,
    validate_at_start: bool,
) -> Schedules:
    """The schedules of the Trainer's ``*_every_n_*`` and ``*_after_n_steps`` keywords."""
    return Schedules(
        publish=Schedule("publish_metrics", publish_every),
        validate=Schedule("validate", *validate),
        checkpoint=Schedule("checkpoint", *checkpoint),
        collect_garbage=Schedule("gc", gc_every),
        validate_at_start=validate_at_start,
    )


def _spike_detector(
    guard: LossSpikeGuard | None, checkpoint_every: int | None
) -> SpikeDetector | None:
    """The detector of ``loss_spike_guard``; a rollback needs checkpoints to go back to."""
    if guard is None:
        return None
    if not isinstance(guard, LossSpikeGuard):
        raise TypeError(
            f"loss_spike_guard must be a LossSpikeGuard, but is {type(guard).__name__} instead."
        )
    if checkpoint_every is None:
        raise ValueError(
            "loss_spike_guard rolls back to a checkpoint, so checkpoint_every_n_steps must be "
            "set too."
        )
    return SpikeDetector(guard)


def _prepare_readers(
    data_reader: DataReader[BatchT],
    valid_data_readers: Sequence[DataReader[Any]] | None,
    device: torch.device | None,
) -> tuple[DataReader[BatchT], list[DataReader[Any]]]:
    """The readers as the loop reads them: validation reads every example once, so a score is
    the mean over the whole valid set; with ``device`` (not the CPU), every micro-batch is moved
    there before the unit sees it."""
    valid = [reader.for_evaluation() for reader in valid_data_readers or []]
    if device is None or device.type == "cpu":
        return data_reader, valid
    return DeviceDataReader(data_reader, device), [DeviceDataReader(r, device) for r in valid]


def _resolve_gangs(
    gangs: Gangs | None, root_gang: Gang | None, dp_gang: Gang | None, tp_gang: Gang | None
) -> Gangs:
    if gangs is not None:
        if root_gang is not None or dp_gang is not None or tp_gang is not None:
            raise ValueError("Pass either gangs or root_gang/dp_gang/tp_gang, not both.")
        return gangs
    if root_gang is None:
        raise ValueError("root_gang (or gangs) must be given.")
    return Gangs.of(root_gang, dp_gang, tp_gang)


def _check_validation(
    valid_units: Sequence[EvalUnit[Any]] | None,
    schedules: Schedules,
    retention: RetentionPolicy,
    scoring: Scoring,
) -> None:
    """Valid units and a validation schedule go together; ranking by score needs both and a
    score."""
    if valid_units and not schedules.validate.is_set:
        raise ValueError(
            "valid_units are given, so validate_every_n_steps or validate_every_n_data_epochs "
            "must be set too."
        )
    if not valid_units and (schedules.validate.is_set or schedules.validate_at_start):
        raise ValueError(
            "A validation schedule is set (validate_every_n_steps, validate_every_n_data_epochs "
            "or validate_at_start), but no valid_units are given. Give valid_units and "
            "valid_data_readers, or leave the schedule out."
        )
    if (retention.uses_score or scoring.early_stopper is not None) and (
        scoring.metric_name is None or not valid_units
    ):
        raise ValueError(
            "keep_best_n_checkpoints, keep_best_n_models and early_stopper rank by a "
            "validation score, so valid_units and score_metric_name must be set too."
        )
    if retention.uses_score:
        check_every_checkpoint_is_scored(schedules.checkpoint, schedules.validate)
    check_snapshots_are_saved(schedules.checkpoint, retention.keep_checkpoint_every_n_steps)
