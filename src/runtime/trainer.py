"""The Trainer: the step loop, and around it validation, checkpoints and metrics."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, final

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from checkpoint import (
    CheckpointChoice,
    CheckpointLayoutError,
    CheckpointManager,
    RetentionPolicy,
)
from gangs import FakeGang, Gang, Gangs, ReduceOperation
from runtime.arguments import check_not_negative, check_positive
from runtime.callbacks import TrainerCallback
from runtime.data import DataReader
from runtime.early_stop import Stateful
from runtime.evaluator import (
    Evaluator,
    check_run_names,
    combine_scores,
    evaluate_units,
)
from runtime.loss_scale import LossScaler
from runtime.parallel import clip_gradient_norm, scale_gradients, skip_gradient_sync
from runtime.profiler import TorchProfiler
from runtime.progress import ProgressDisplay, make_progress_display
from runtime.recorders import (
    CompositeMetricRecorder,
    JsonlMetricRecorder,
    LogMetricRecorder,
    MetricRecorder,
    TensorBoardRecorder,
    WandbRecorder,
)
from units import EvalUnit, TrainUnit

log = logging.getLogger(__name__)

BatchT = TypeVar("BatchT")

EarlyStopperFn = Callable[[int, float], bool]

PREEMPTED_EXIT_CODE = 75
"""``Trainer.run()`` returns it (EX_TEMPFAIL) after SIGTERM or SIGUSR1: a checkpoint was saved at the
step every rank agreed on; launch the same command again to resume."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainerError(RuntimeError):
    """The training cannot go on: the data or the unit broke an invariant the Trainer needs."""


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
        optimizer: Optimizer,
        checkpoint_manager: CheckpointManager,
        root_gang: Gang | None = None,
        dp_gang: Gang | None = None,
        tp_gang: Gang | None = None,
        gangs: Gangs | None = None,
        dtype: torch.dtype = torch.float32,
        lr_scheduler: LRScheduler | None = None,
        max_num_steps: int | None = None,
        max_num_data_epochs: int | None = None,
        valid_units: Sequence[EvalUnit[Any]] | None = None,
        valid_data_readers: Sequence[DataReader[Any]] | None = None,
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
        async_checkpoint: bool = False,
        reshard_on_resume: bool = False,
        score_metric_name: str | None = None,
        lower_better: bool = False,
        early_stopper: EarlyStopperFn | None = None,
        publish_metrics_every_n_steps: int | None = None,
        tb_dir: Path | None = None,
        metrics_dir: Path | None = None,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        wandb_dir: Path | None = None,
        wandb_config: Mapping[str, object] | None = None,
        fp16_loss_scale: tuple[float, float] = (128.0, 0.0001),
        max_gradient_norm: float | None = None,
        amp: bool = False,
        anomaly_detection: bool = False,
        profiler: TorchProfiler | None = None,
        seed: int = 2,
        callbacks: Sequence[TrainerCallback] = (),
        progress: bool = True,
    ) -> None:
        if gangs is not None:
            if root_gang is not None or dp_gang is not None or tp_gang is not None:
                raise ValueError("Pass either gangs or root_gang/dp_gang/tp_gang, not both.")
        elif root_gang is None:
            raise ValueError("root_gang (or gangs) must be given.")
        else:
            gangs = Gangs(
                root=root_gang,
                dp=dp_gang or root_gang,
                tp=tp_gang or FakeGang(device=root_gang.device),
            )
        if gangs.dp.size * gangs.tp.size != gangs.root.size:
            raise ValueError(
                f"The DP gang ({gangs.dp.size}) times the TP gang ({gangs.tp.size}) must make up "
                f"the root gang ({gangs.root.size})."
            )

        for name, value in (
            ("max_num_steps", max_num_steps),
            ("max_num_data_epochs", max_num_data_epochs),
            ("validate_every_n_steps", validate_every_n_steps),
            ("validate_every_n_data_epochs", validate_every_n_data_epochs),
            ("checkpoint_every_n_steps", checkpoint_every_n_steps),
            ("checkpoint_every_n_data_epochs", checkpoint_every_n_data_epochs),
            ("publish_metrics_every_n_steps", publish_metrics_every_n_steps),
            ("max_gradient_norm", max_gradient_norm),
        ):
            check_positive(name, value)
        check_not_negative("validate_after_n_steps", validate_after_n_steps)
        check_not_negative("checkpoint_after_n_steps", checkpoint_after_n_steps)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype must be torch.float32, torch.bfloat16 or torch.float16, but is {dtype} instead."
            )

        valid_units = list(valid_units or [])
        valid_data_readers = list(valid_data_readers or [])
        if len(valid_units) != len(valid_data_readers):
            raise ValueError(
                f"valid_units and valid_data_readers must have the same length, but have "
                f"{len(valid_units)} and {len(valid_data_readers)} elements instead."
            )
        check_run_names(valid_units)
        if valid_units and validate_every_n_steps is None and validate_every_n_data_epochs is None:
            raise ValueError(
                "valid_units are given, so validate_every_n_steps or validate_every_n_data_epochs "
                "must be set too."
            )

        self._retention = RetentionPolicy(
            keep_last_n_checkpoints=keep_last_n_checkpoints,
            keep_best_n_checkpoints=keep_best_n_checkpoints,
            keep_last_n_models=keep_last_n_models,
            keep_best_n_models=keep_best_n_models,
            lower_better=lower_better,
        )
        if (self._retention.uses_score or early_stopper is not None) and (
            score_metric_name is None or not valid_units
        ):
            raise ValueError(
                "keep_best_n_checkpoints, keep_best_n_models and early_stopper rank by a "
                "validation score, so valid_units and score_metric_name must be set too."
            )
        stopper_lower_better = getattr(early_stopper, "lower_better", None)
        if isinstance(stopper_lower_better, bool) and stopper_lower_better != lower_better:
            raise ValueError(
                f"early_stopper ranks scores with lower_better={stopper_lower_better}, but the "
                f"Trainer has lower_better={lower_better}. Give both the same orientation."
            )
        if self._retention.uses_score:
            _check_every_checkpoint_is_scored(
                checkpoint_every_n_steps=checkpoint_every_n_steps,
                checkpoint_after_n_steps=checkpoint_after_n_steps,
                checkpoint_every_n_data_epochs=checkpoint_every_n_data_epochs,
                validate_every_n_steps=validate_every_n_steps,
                validate_after_n_steps=validate_after_n_steps,
                validate_every_n_data_epochs=validate_every_n_data_epochs,
            )

        self._unit = unit
        self._model = unit.model
        self._data_reader = data_reader
        self._optimizer = optimizer
        self._checkpoint_manager = checkpoint_manager
        self._gangs = gangs
        self._dtype = dtype
        self._lr_scheduler = lr_scheduler
        self._max_num_steps = max_num_steps
        self._max_num_data_epochs = max_num_data_epochs
        self._valid_units = valid_units
        self._valid_data_readers = valid_data_readers
        self._validate_every_n_steps = validate_every_n_steps
        self._validate_after_n_steps = validate_after_n_steps
        self._validate_every_n_data_epochs = validate_every_n_data_epochs
        self._validate_at_start = validate_at_start
        self._checkpoint_every_n_steps = checkpoint_every_n_steps
        self._checkpoint_after_n_steps = checkpoint_after_n_steps
        self._checkpoint_every_n_data_epochs = checkpoint_every_n_data_epochs
        self._callbacks = list(callbacks)
        self._score_metric_name = score_metric_name
        self._lower_better = lower_better
        self._early_stopper = early_stopper
        self._publish_every_n_steps = publish_metrics_every_n_steps
        self._max_gradient_norm = max_gradient_norm
        self._amp = amp
        self._anomaly_detection = anomaly_detection
        self._profiler = profiler
        self._seed = seed
        self._async_checkpoint = async_checkpoint
        self._reshard_on_resume = reshard_on_resume
        self._loss_scaler = LossScaler(
            init_scale=fp16_loss_scale[0],
            min_scale=fp16_loss_scale[1],
            enabled=dtype == torch.float16,
        )

        self._step_nr = 0
        self._data_epoch_nr = 1
        self._last_validated_step: int | None = None
        self._last_checkpoint_step: int | None = None
        self._stop_requested = False
        self._preempted = False
        self._finished = False
        # Why a finished run finished: an early stop is final, but a run that used up its steps
        # or data epochs trains on when launched again with a larger limit.
        self._early_stopped = False
        self._data_exhausted = False
        self._last_score: float | None = None
        self._best_score: float | None = None
        self._best_step_nr: int | None = None
        self._window = _MetricWindow(gangs.dp.device)
        self._run_start = time.perf_counter()

        is_writer = gangs.root.rank == 0
        self._recorder = self._make_recorder(
            is_writer, tb_dir, metrics_dir, wandb_project, wandb_run_name, wandb_dir, wandb_config
        )
        self._progress: ProgressDisplay = make_progress_display(enabled=progress and is_writer)

    @property
    def step_nr(self) -> int:
        return self._step_nr

    @property
    def gangs(self) -> Gangs:
        return self._gangs

    # ------------------------------------------------------------------- run

    def run(self) -> int:
        """Train until a stop condition; return the process exit status (0 when finished)."""
        with contextlib.ExitStack() as stack:
            stack.callback(self._recorder.close)
            stack.callback(self._progress.close)
            if self._anomaly_detection:
                stack.enter_context(torch.autograd.detect_anomaly())
            stack.enter_context(self._stop_on_signals())

            self._seed_rngs()
            self._checkpoint_manager.remove_leftovers()
            self._maybe_resume()
            if self._finished:
                log.info("The run finished at step %d already; nothing to do.", self._step_nr)
                return 0

            if self._profiler is not None:
                stack.enter_context(self._profiler)
            self._progress.start(total_steps=self._max_num_steps, initial_step=self._step_nr)
            self._model.train()
            for callback in self._callbacks:
                callback.on_train_begin(step_nr=self._step_nr)
            if self._validate_at_start and self._step_nr == 0 and self._valid_units:
                self._validate(baseline=True)
            self._train()
            # An asynchronous save of the last step commits here; after a crash it never does.
            self._finish_pending_checkpoint()
            if self._finished:
                for callback in self._callbacks:
                    callback.on_train_end(step_nr=self._step_nr)
        return PREEMPTED_EXIT_CODE if self._preempted and not self._finished else 0

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """Turn SIGTERM/SIGUSR1 into a request that the next step boundary honours on all ranks."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, _frame: object) -> None:
            log.warning(
                "Received %s: stopping at the next step boundary.", signal.Signals(signum).name
            )
            self._stop_requested = True

        previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _train(self) -> None:
        log.info("Training from step %d.", self._step_nr)
        self._run_start = time.perf_counter()
        self._window.restart_clock()
        while self._max_num_steps is None or self._step_nr < self._max_num_steps:
            batches = self._next_batches()
            if batches is None:
                break
            self._step_nr += 1
            self._run_step(batches)
            self._progress.advance(self._step_nr)
            if self._profiler is not None:
                self._profiler.step()
            for callback in self._callbacks:
                callback.on_step_end(step_nr=self._step_nr)

            if self._should(self._publish_every_n_steps):
                self._publish_train_metrics()
            stop = False
            if self._should(self._validate_every_n_steps, self._validate_after_n_steps):
                stop = self._validate()
            # Known before the save, so a checkpoint of the last step says the run is over.
            self._finished = stop or self._step_nr == self._max_num_steps
            if (
                self._should(self._checkpoint_every_n_steps, self._checkpoint_after_n_steps)
                or self._preempted
            ):
                self._save_checkpoint()
            if self._preempted and not self._finished:
                # The unpublished metric window is in the checkpoint, so after the resume the
                # published values are those of an uninterrupted run.
                log.warning("Stopped at step %d as requested by a signal.", self._step_nr)
                return
            if stop:
                break

        self._finished = True
        if self._window.num_steps > 0:
            self._publish_train_metrics()
        if self._valid_units and self._last_validated_step != self._step_nr:
            self._validate()
        if self._last_checkpoint_step != self._step_nr:
            self._save_checkpoint()
        log.info("Training finished at step %d.", self._step_nr)
        if self._best_score is not None:
            log.info(
                "The best validation score was %g, at step %s.",
                self._best_score,
                self._best_step_nr,
            )

    def _should(self, every_n_steps: int | None, after_n_steps: int = 0) -> bool:
        return (
            every_n_steps is not None
            and self._step_nr > after_n_steps
            and self._step_nr % every_n_steps == 0
        )

    def _on_data_epoch_end(self) -> bool:
        """Validate and checkpoint on the epoch schedules; return whether to stop early."""
        epoch = self._data_epoch_nr
        stop = False
        every = self._validate_every_n_data_epochs
        if every is not None and epoch % every == 0 and self._last_validated_step != self._step_nr:
            stop = self._validate()
        every = self._checkpoint_every_n_data_epochs
        if every is not None and epoch % every == 0 and self._last_checkpoint_step != self._step_nr:
            self._finished = stop
            self._save_checkpoint()
        return stop

    def evaluate_checkpoint(self, which: CheckpointChoice = "last") -> dict[str, dict[str, Any]]:
        """Load the model of a checkpoint and run the valid units on it, published as ``eval``.

        ``which`` is ``"last"``, ``"best"`` (by the score stored with each checkpoint, oriented
        by ``lower_better``) or a step number. The values are recorded at the checkpoint's step
        under the run ``eval`` (``eval/<display_name>`` for named units), with the same metric
        names as ``valid``, and returned by run name. The recorders are closed afterwards: a
        trainer used for this is not meant to ``run()`` too.
        """
        if not self._valid_units:
            raise ValueError("Evaluating a checkpoint needs valid_units and valid_data_readers.")
        evaluator = Evaluator(
            model=self._model,
            units=self._valid_units,
            data_readers=self._valid_data_readers,
            gangs=self._gangs,
            recorder=self._recorder,
            run_prefix="eval",
            autocast=self._autocast,
        )
        try:
            return evaluator.evaluate_checkpoint(
                self._checkpoint_manager, which, lower_better=self._lower_better
            )
        finally:
            self._recorder.close()

    # ------------------------------------------------------------------ step

    def _next_batches(self) -> list[BatchT] | None:
        """The next step's micro-batches; ``None`` once ``max_num_data_epochs`` are done."""
        empty_epochs = 0
        while True:
            start = time.perf_counter()
            try:
                batches = next(self._data_reader)
            except StopIteration:
                self._window.data_wait_time += time.perf_counter() - start
            else:
                self._window.data_wait_time += time.perf_counter() - start
                if not batches:
                    raise TrainerError(
                        f"The data reader returned no micro-batches for step {self._step_nr + 1}. "
                        "Training readers must use SyncMode.UNTIL_FIRST."
                    )
                return batches

            log.info("Data epoch %d ended at step %d.", self._data_epoch_nr, self._step_nr)
            if (
                self._max_num_data_epochs is not None
                and self._data_epoch_nr >= self._max_num_data_epochs
            ):
                # The end of training validates and checkpoints this step; a checkpoint saved
                # here would say the run is unfinished and miss the last train metrics.
                self._data_exhausted = True
                return None
            if self._step_nr > 0 and self._on_data_epoch_end():
                return None
            empty_epochs += 1
            if empty_epochs > 1:
                raise TrainerError(
                    f"The data reader ended epoch {self._data_epoch_nr} without a single batch. "
                    "Check the dataset size against batch_size, num_accumulate and the DP gang."
                )
            self._data_epoch_nr += 1
            self._data_reader.reset()

    def _run_step(self, batches: list[BatchT]) -> None:
        step_nr = self._step_nr
        self._unit.set_step_nr(step_nr)
        if self._loss_scaler.enabled:
            self._unit.metric_bag.begin_updates()

        device_loss = torch.zeros((), device=self._gangs.dp.device, dtype=torch.float64)
        local_weight = 0
        num_examples = 0
        counted_targets: bool | None = None
        last = len(batches) - 1
        for index, batch in enumerate(batches):
            with skip_gradient_sync(self._model, index < last):
                with self._autocast():
                    loss, num_targets = self._unit(batch)
                if counted_targets is None:
                    counted_targets = num_targets is not None
                elif counted_targets != (num_targets is not None):
                    raise TrainerError(
                        f"The unit returned a target count for some micro-batches of step {step_nr} "
                        "and None for others. Return one or the other for every batch."
                    )
                if num_targets is not None and num_targets < 0:
                    raise TrainerError(
                        f"The unit returned {num_targets} targets at step {step_nr}; a count must "
                        "be zero or more."
                    )
                torch.autograd.backward(loss * self._loss_scaler.scale)
            device_loss += loss.detach()
            local_weight += 1 if num_targets is None else num_targets
            num_examples += _num_examples(batch)

        # One CPU all-reduce per step, the one the normalization needs: the DP-wide target count.
        # A stop request rides along, so every rank stops at the same step at no extra cost.
        # TP ranks of one DP rank see the same batch, so the root-wide sum counts each tp.size times.
        totals = torch.tensor(
            [float(local_weight), float(num_examples), float(self._stop_requested)],
            dtype=torch.float64,
        )
        self._gangs.root.all_reduce(totals, ReduceOperation.SUM)
        total_weight, total_examples = (totals[:2] / self._gangs.tp.size).tolist()
        self._preempted = bool(totals[2] > 0)
        if total_weight == 0:
            raise TrainerError(
                f"The batches of step {step_nr} have no targets on any data-parallel rank, so the "
                "loss cannot be normalized. Check that the data yields non-empty targets."
            )

        # DDP and FSDP average gradients over the DP gang; this turns the average of per-rank sums
        # into the sum over all targets divided by their count.
        scale_gradients(self._model, self._gangs.dp.size / (total_weight * self._loss_scaler.scale))
        grad_norm = clip_gradient_norm(self._model, self._max_gradient_norm)

        if self._loss_scaler.update(grad_norm, step_nr):
            self._optimizer.step()
            if self._loss_scaler.enabled:
                self._unit.metric_bag.commit_updates()
        else:
            self._unit.metric_bag.rollback_updates()
        self._optimizer.zero_grad(set_to_none=True)
        if self._lr_scheduler is not None:
            self._lr_scheduler.step()

        self._window.add_step(
            loss_sum=device_loss,
            local_weight=local_weight,
            total_weight=total_weight,
            total_examples=total_examples,
            grad_norm=grad_norm,
        )

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self._amp or self._dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._gangs.dp.device.type, dtype=self._dtype)

    # --------------------------------------------------------------- metrics

    def _publish_train_metrics(self) -> None:
        values = self._window.compute(self._gangs.dp)
        values["lr"] = self._current_lr()
        values["data_epoch"] = self._data_epoch_nr
        values["elapsed_time"] = time.perf_counter() - self._run_start
        if self._loss_scaler.enabled:
            values["loss_scale"] = self._loss_scaler.scale
        values.update(self._unit.metric_bag.sync_and_compute(self._gangs.dp))
        self._unit.metric_bag.reset_non_persistent_metrics()
        self._window.reset()

        self._recorder.record_metrics("train", values, self._step_nr)
        for callback in self._callbacks:
            callback.on_metrics_published(run="train", step_nr=self._step_nr, values=values)
        self._progress.update_values(
            {k: float(v) for k, v in values.items() if k in ("loss", "lr", "grad_norm")}
        )

    def _current_lr(self) -> float:
        if self._lr_scheduler is not None:
            return float(self._lr_scheduler.get_last_lr()[0])
        return float(self._optimizer.param_groups[0]["lr"])

    @staticmethod
    def _make_recorder(
        is_writer: bool,
        tb_dir: Path | None,
        metrics_dir: Path | None,
        wandb_project: str | None,
        wandb_run_name: str | None,
        wandb_dir: Path | None,
        wandb_config: Mapping[str, object] | None,
    ) -> MetricRecorder:
        recorders: list[MetricRecorder] = []
        if is_writer:
            recorders.append(LogMetricRecorder(log))
            if metrics_dir is not None:
                recorders.append(JsonlMetricRecorder(metrics_dir))
            if tb_dir is not None:
                recorders.append(TensorBoardRecorder(tb_dir))
            if wandb_project is not None:
                wandb_base = wandb_dir or metrics_dir or tb_dir
                if wandb_base is None:
                    raise ValueError(
                        "wandb_project needs wandb_dir (or metrics_dir) for its files."
                    )
                recorders.append(
                    WandbRecorder(
                        project=wandb_project,
                        output_dir=wandb_base,
                        run_name=wandb_run_name,
                        config=wandb_config,
                    )
                )
        return CompositeMetricRecorder(recorders)

    # ------------------------------------------------------------ validation

    def _validate(self, *, baseline: bool = False) -> bool:
        """Run every valid unit to the end of its data; return whether to stop early.

        A ``baseline`` validation (``validate_at_start``, before the first step) publishes its
        values, but its score neither competes for the best nor goes to the early stopper: no
        checkpoint holds the untrained model.
        """
        self._last_validated_step = self._step_nr
        results = evaluate_units(
            model=self._model,
            units=self._valid_units,
            data_readers=self._valid_data_readers,
            gangs=self._gangs,
            step_nr=self._step_nr,
            recorder=self._recorder,
            autocast=self._autocast,
        )
        for run, values in results.items():
            for callback in self._callbacks:
                callback.on_metrics_published(run=run, step_nr=self._step_nr, values=values)

        score = None
        if self._score_metric_name is not None and baseline:
            score = combine_scores(results, self._score_metric_name)
            log.info("Validation score before training: %g (a baseline, not ranked).", score)
        elif self._score_metric_name is not None:
            score = combine_scores(results, self._score_metric_name)
            # A non-finite score (a diverged model) is never the best, and its checkpoint is
            # stored unscored, so keep-best and --evaluate best never pick it.
            finite = math.isfinite(score)
            self._last_score = score if finite else None
            if finite and (
                self._best_score is None
                or (score < self._best_score if self._lower_better else score > self._best_score)
            ):
                self._best_score, self._best_step_nr = score, self._step_nr
            if not finite:
                log.warning(
                    "The validation score at step %d is %g: it never counts as the best.",
                    self._step_nr,
                    score,
                )
            if self._best_score is not None:
                log.info(
                    "Validation score at step %d: %g (best: %g at step %s).",
                    self._step_nr,
                    score,
                    self._best_score,
                    self._best_step_nr,
                )
        for callback in self._callbacks:
            callback.on_validation_end(step_nr=self._step_nr, score=score, results=results)
        return score is not None and not baseline and self._ask_early_stopper(score)

    def _ask_early_stopper(self, score: float) -> bool:
        if self._early_stopper is None:
            return False
        # Rank 0 decides, the others follow. A stopper that raises fails every rank with a clear
        # error, instead of leaving the others waiting in the broadcast for a rank that is gone.
        decision: list[bool | str] = [False]
        error: Exception | None = None
        if self._gangs.root.rank == 0:
            try:
                decision[0] = bool(self._early_stopper(self._step_nr, score))
            except Exception as ex:
                error = ex
                decision[0] = f"{type(ex).__name__}: {ex}"
        self._gangs.root.broadcast_objects(decision)
        if error is not None:
            raise error
        if isinstance(decision[0], str):
            raise TrainerError(
                f"The early stopper failed on rank 0 at step {self._step_nr}: {decision[0]}"
            )
        if decision[0]:
            self._early_stopped = True
            log.info("The early stopper stopped the training at step %d.", self._step_nr)
            for callback in self._callbacks:
                callback.on_early_stop(step_nr=self._step_nr, score=score)
        return decision[0]

    # ----------------------------------------------------------- checkpoints

    def _save_checkpoint(self) -> None:
        # Retention and the callbacks see only committed checkpoints, so the previous
        # asynchronous save commits first.
        self._finish_pending_checkpoint()
        score = self._last_score if self._last_validated_step == self._step_nr else None
        self._checkpoint_manager.save_checkpoint(
            self._step_nr,
            model=self._model,
            optimizer=self._optimizer,
            trainer_state=self._state_dict(),
            score=score,
            async_checkpoint=self._async_checkpoint,
        )
        self._last_checkpoint_step = self._step_nr
        if not self._async_checkpoint:
            self._after_checkpoint_commit(self._step_nr)

    def _finish_pending_checkpoint(self) -> None:
        step_nr = self._checkpoint_manager.finish_pending_save()
        if step_nr is not None:
            self._after_checkpoint_commit(step_nr)

    def _after_checkpoint_commit(self, step_nr: int) -> None:
        self._checkpoint_manager.apply_retention(self._retention)
        for callback in self._callbacks:
            callback.on_checkpoint_saved(
                step_nr=step_nr,
                checkpoint_dir=self._checkpoint_manager.checkpoint_dir / f"step_{step_nr}",
            )

    def _maybe_resume(self) -> None:
        loaded = self._checkpoint_manager.load_last_checkpoint(
            model=self._model, optimizer=self._optimizer, reshard=self._reshard_on_resume
        )
        if loaded is None:
            return
        self._load_state_dict(loaded.trainer_state, resharded=loaded.resharded)
        self._last_checkpoint_step = self._step_nr
        log.info("Resumed from the checkpoint of step %d.", self._step_nr)
        if self._finished and not self._early_stopped and not self._limit_reached():
            log.info(
                "The run finished at step %d, but max_num_steps (%s) and max_num_data_epochs "
                "(%s) now allow more: training on.",
                self._step_nr,
                self._max_num_steps,
                self._max_num_data_epochs,
            )
            self._finished = False
            self._data_exhausted = False

    def _limit_reached(self) -> bool:
        """Whether ``max_num_steps`` or ``max_num_data_epochs`` ends the training here."""
        if self._max_num_steps is not None and self._step_nr >= self._max_num_steps:
            return True
        return (
            self._data_exhausted
            and self._max_num_data_epochs is not None
            and self._data_epoch_nr >= self._max_num_data_epochs
        )

    def _state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step_nr": self._step_nr,
            "data_epoch_nr": self._data_epoch_nr,
            "finished": self._finished,
            "early_stopped": self._early_stopped,
            "data_exhausted": self._data_exhausted,
            "data_reader": self._data_reader.state_dict(),
            "rng": _rng_state(),
            "loss_scaler": self._loss_scaler.state_dict(),
            "train_metrics": self._unit.metric_bag.state_dict(),
            "window": self._window.state_dict(),
            "last_score": self._last_score,
            "best_score": self._best_score,
            "best_step_nr": self._best_step_nr,
            "last_validated_step": self._last_validated_step,
        }
        if self._lr_scheduler is not None:
            state["lr_scheduler"] = self._lr_scheduler.state_dict()
        if isinstance(self._early_stopper, Stateful):
            state["early_stopper"] = self._early_stopper.state_dict()
        return state

    def _load_state_dict(self, state: Mapping[str, Any], *, resharded: bool = False) -> None:
        """Load this rank's trainer state, or rank 0's when the checkpoint was ``resharded``.

        After a reshard, what all ranks share (step, schedules, scores, loss scale) carries over
        and the data reader reshards its position; what is per rank cannot: the RNGs are seeded
        anew for this step, and the unpublished metric window starts empty.
        """
        self._step_nr = int(state["step_nr"])
        self._data_epoch_nr = int(state["data_epoch_nr"])
        self._finished = bool(state["finished"])
        self._early_stopped = bool(state["early_stopped"])
        self._data_exhausted = bool(state["data_exhausted"])
        if resharded:
            try:
                self._data_reader.load_state_dict(state["data_reader"])
            except ValueError as ex:
                raise CheckpointLayoutError(str(ex)) from ex
            self._seed_rngs(step_nr=self._step_nr)
            log.warning(
                "Resumed from another world layout: the data position was resharded and the "
                "RNGs seeded anew, so the run is no longer bit-identical to an uninterrupted one, "
                "and the first train metrics published cover only the steps after step %d.",
                self._step_nr,
            )
        else:
            self._data_reader.load_state_dict(state["data_reader"])
            _set_rng_state(state["rng"])
            self._unit.metric_bag.load_state_dict(state["train_metrics"])
            self._window.load_state_dict(state["window"])
        self._loss_scaler.load_state_dict(state["loss_scaler"])
        self._last_score = state["last_score"]
        self._best_score = state["best_score"]
        self._best_step_nr = state["best_step_nr"]
        self._last_validated_step = state["last_validated_step"]
        if self._lr_scheduler is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        if isinstance(self._early_stopper, Stateful) and "early_stopper" in state:
            self._early_stopper.load_state_dict(state["early_stopper"])

    def _seed_rngs(self, *, step_nr: int = 0) -> None:
        # TP ranks of one DP rank must draw the same numbers (e.g. dropout on replicated
        # activations); DP ranks see different data and draw different ones. After a reshard,
        # the step keeps the numbers apart from those already drawn.
        seed = self._seed + self._gangs.dp.rank + step_nr * self._gangs.dp.size
        random.seed(seed)
        torch.manual_seed(seed)


@final
class _MetricWindow:
    """What the Trainer measures between two publishes, kept on the device until then."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self._device, dtype=torch.float64)
        self.grad_norm_sum = torch.zeros((), device=self._device, dtype=torch.float32)
        self.local_weight = 0
        self.total_weight = 0.0
        self.total_examples = 0.0
        self.num_steps = 0
        self.data_wait_time = 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        self._start = time.perf_counter()

    def add_step(
        self,
        *,
        loss_sum: Tensor,
        local_weight: int,
        total_weight: float,
        total_examples: float,
        grad_norm: Tensor,
    ) -> None:
        self.loss_sum += loss_sum
        self.grad_norm_sum += grad_norm.detach().to(self._device, torch.float32)
        self.local_weight += local_weight
        self.total_weight += total_weight
        self.total_examples += total_examples
        self.num_steps += 1

    def compute(self, dp_gang: Gang) -> dict[str, Any]:
        sums = torch.stack(
            [
                self.loss_sum,
                torch.tensor(float(self.local_weight), device=self._device, dtype=torch.float64),
            ]
        )
        dp_gang.all_reduce(sums, ReduceOperation.SUM)
        loss_sum, weight = sums.tolist()
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        steps = max(self.num_steps, 1)
        return {
            "loss": loss_sum / weight if weight else math.nan,
            "grad_norm": self.grad_norm_sum.item() / steps,
            "num_targets": self.total_weight,
            "targets_per_second": self.total_weight / elapsed,
            "batch_size": self.total_examples / steps,
            "data_wait_time": self.data_wait_time,
            "num_steps": self.num_steps,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_sum": self.loss_sum.cpu(),
            "grad_norm_sum": self.grad_norm_sum.cpu(),
            "local_weight": self.local_weight,
            "total_weight": self.total_weight,
            "total_examples": self.total_examples,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loss_sum = state["loss_sum"].to(self._device)
        self.grad_norm_sum = state["grad_norm_sum"].to(self._device)
        self.local_weight = int(state["local_weight"])
        self.total_weight = float(state["total_weight"])
        self.total_examples = float(state["total_examples"])
        self.num_steps = int(state["num_steps"])


def _num_examples(batch: object) -> int:
    """Examples in a micro-batch: ``batch.batch_size`` if it has one, else ``len(batch)``."""
    size = getattr(batch, "batch_size", None)
    if isinstance(size, int):
        return size
    try:
        return len(batch)  # type: ignore[arg-type]
    except TypeError:
        return 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_every_checkpoint_is_scored(
    *,
    checkpoint_every_n_steps: int | None,
    checkpoint_after_n_steps: int,
    checkpoint_every_n_data_epochs: int | None,
    validate_every_n_steps: int | None,
    validate_after_n_steps: int,
    validate_every_n_data_epochs: int | None,
) -> None:
    """Keep-best ranks checkpoints by score: each scheduled one must follow a validation."""
    if checkpoint_every_n_steps is not None and (
        validate_every_n_steps is None
        or checkpoint_every_n_steps % validate_every_n_steps != 0
        or checkpoint_after_n_steps < validate_after_n_steps
    ):
        raise ValueError(
            "With keep-best retention every checkpoint needs a score, so checkpoint_every_n_steps "
            f"({checkpoint_every_n_steps}) must be a multiple of validate_every_n_steps "
            f"({validate_every_n_steps}), and checkpoint_after_n_steps "
            f"({checkpoint_after_n_steps}) at least validate_after_n_steps ({validate_after_n_steps})."
        )
    if checkpoint_every_n_data_epochs is not None and (
        validate_every_n_data_epochs is None
        or checkpoint_every_n_data_epochs % validate_every_n_data_epochs != 0
    ):
        raise ValueError(
            "With keep-best retention every checkpoint needs a score, so "
            f"checkpoint_every_n_data_epochs ({checkpoint_every_n_data_epochs}) must be a multiple "
            f"of validate_every_n_data_epochs ({validate_every_n_data_epochs})."
        )
