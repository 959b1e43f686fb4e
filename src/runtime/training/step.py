"""One optimizer step: forward and backward over the micro-batches, normalization, clipping,
loss scaling, the optimizer and the LR scheduler."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar, final

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from checkpoint.state_keys import check_state_keys
from gangs import Gangs
from runtime.errors import TrainerError
from runtime.metrics.tracing import (
    BACKWARD,
    FORWARD,
    GRADIENT_SYNC,
    OPTIMIZER_STEP,
    trace_ranges,
)
from runtime.metrics.train_metrics import StepOutput
from runtime.parallel.sparse_embeddings import check_sparse_outside_ddp
from runtime.training.gradients import Gradients, gradient_sync_switch
from runtime.training.loss_scale import LossScaler
from runtime.training.non_finite import NanPolicy, NonFiniteGuard
from runtime.training.step_totals import StepTotals
from trainkit_utils.arguments import check_positive
from units import TrainUnit
from units.callback import TrainerCallback

log = logging.getLogger(__name__)

BatchT = TypeVar("BatchT")


@final
@dataclass(frozen=True)
class Precision:
    """The Trainer's ``dtype``, ``amp`` and ``fp16_loss_scale``: ``(initial, minimum)``, or
    ``(initial, minimum, growth_interval)``; loss scaling is on with float16 only."""

    dtype: torch.dtype = torch.float32
    amp: bool = False
    fp16_loss_scale: tuple[float, ...] = (128.0, 0.0001)

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                "dtype must be torch.float32, torch.bfloat16 or torch.float16, but is "
                f"{self.dtype} instead."
            )


class TrainStep(Generic[BatchT]):
    """Runs ``unit`` over a step's micro-batches and updates the model with ``optimizer``.

    The gradients are scaled so that the update is the mean over all targets of the step, across
    gradient accumulation and the data-parallel gang: *sum of losses / total targets*. Under
    sequence parallelism each rank's loss and targets are those of its part of the sequences,
    and both add up over DP x SP (:attr:`gangs.Gangs.dp_sp`), as the gradients do.

    Under pipeline parallelism :class:`~runtime.training.pipeline_step.PipelineTrainStep` runs
    the forward and backward instead (:meth:`_forward_backward`); the rest is this class's.
    """

    def __init__(
        self,
        *,
        unit: TrainUnit[BatchT],
        optimizer: Optimizer | Sequence[Optimizer],
        gangs: Gangs,
        lr_scheduler: LRScheduler | Sequence[LRScheduler] | None = None,
        precision: Precision = Precision(),
        max_gradient_norm: float | None = None,
        nan_policy: NanPolicy = "error",
        max_consecutive_skipped_steps: int = 10,
        trace: bool = False,
        callbacks: TrainerCallback | None = None,
    ) -> None:
        check_positive("max_gradient_norm", max_gradient_norm)
        self._unit = unit
        self._callbacks = callbacks
        self._model = unit.model
        self.optimizers = as_optimizers(optimizer)
        self._lr_schedulers = _as_schedulers(lr_scheduler)
        self._gangs = gangs
        self._dtype = precision.dtype
        self._autocasts = precision.amp and precision.dtype != torch.float32
        self._max_gradient_norm = max_gradient_norm
        self._trace = trace
        self._loss_scaler = LossScaler.from_option(
            precision.fp16_loss_scale, enabled=precision.dtype == torch.float16
        )
        self.guard = NonFiniteGuard(
            policy=nan_policy,
            max_consecutive_skipped_steps=max_consecutive_skipped_steps,
            root_gang=gangs.root,
            checks_gradients=not self._loss_scaler.enabled,
        )
        check_sparse_outside_ddp(self._model)
        self._gradients = Gradients(self._model, dp_gang=gangs.dp_sp, pp_gang=gangs.pp)
        self._totals = StepTotals(gangs=gangs, check_losses=self.guard.skips)
        # The ranks DDP and FSDP average gradients over: DP x SP (each SP rank's gradients
        # are those of its part of the sequences, and they add up).
        self._dp_size = gangs.dp_sp.size
        self._switch_gradient_sync = gradient_sync_switch(self._model)
        # A step is skipped on an fp16 overflow, or with nan_policy="skip" on a non-finite value.
        self._may_skip = self._loss_scaler.enabled or self.guard.skips
        # A profiler's named range around each phase; without one, one shared no-op context.
        self._range = trace_ranges(trace)
        self.lr_scale = 1.0
        """A factor on every learning rate for the optimizer step alone (the schedulers and the
        published ``lr`` do not see it): the cooling after a loss-spike rollback."""

    def __call__(
        self,
        batches: list[BatchT],
        *,
        step_nr: int,
        stop_requested: bool,
        measure_grad_norm: bool = True,
    ) -> StepOutput:
        """Take the step. The gradient norm is measured when ``measure_grad_norm`` (the loop
        asks on the steps that publish it), and always with clipping, ``nan_policy="skip"`` or
        fp16, which decide on it: elsewhere it is work no one reads.
        """
        self._unit.set_step_nr(step_nr)
        may_skip = self._may_skip
        if may_skip:
            self._unit.metric_bag.begin_updates()

        # Forward and backward of each micro-batch, each in its range.
        loss_scale = self._loss_scaler.scale
        losses, num_targets, last_loss = self._forward_backward(
            batches, step_nr, stop_requested, loss_scale
        )
        total_targets, total_examples, stop_votes, non_finite_votes = self._totals.wait()
        if total_targets == 0:
            raise TrainerError(
                f"The batches of step {step_nr} have no targets on any data-parallel rank, so the "
                "loss cannot be normalized. Check that the data yields non-empty targets."
            )

        with self._range(GRADIENT_SYNC):
            non_finite, grad_norm = self._normalize_gradients(
                total_targets * loss_scale, measure_grad_norm or may_skip
            )

        applied = True
        if may_skip:
            assert grad_norm is not None
            applied = self._loss_scaler.update(grad_norm, step_nr) and (
                not self.guard.skips
                or self.guard.allows_step(
                    step_nr=step_nr,
                    loss_finite_here=self._totals.loss_finite_here,
                    losses_finite_everywhere=non_finite_votes == 0,
                    grad_norm=grad_norm,
                )
            )
        if applied and self._callbacks is not None:
            self._callbacks.on_before_optimizer_step(step_nr=step_nr, model=self._model)

        with self._range(OPTIMIZER_STEP):
            self._update_model(applied, may_skip)
        # The last loss (and its spent graph) lives until after the update, as in a
        # hand-written loop: freeing the graph first makes the optimizer step slower on CPU.
        del last_loss
        return StepOutput(
            step_nr=step_nr,
            losses=losses,
            num_targets=num_targets,
            total_targets=total_targets,
            total_examples=total_examples,
            grad_norm=grad_norm,
            non_finite_gradients=non_finite,
            stop_requested=stop_votes > 0,
            applied=applied,
        )

    def _forward_backward(
        self, batches: list[BatchT], step_nr: int, stop_requested: bool, loss_scale: float
    ) -> tuple[list[Tensor], int, Tensor]:
        """Backpropagate each micro-batch's summed loss, and start the step's totals over the
        ranks during the last backward; return the losses, this rank's target count, and the
        last micro-batch's loss itself, with its graph."""
        losses: list[Tensor] = []
        num_targets = 0
        num_examples = 0
        counted_targets: bool | None = None
        last = len(batches) - 1
        # DP gradient reduction waits for the last micro-batch.
        switch_sync = self._switch_gradient_sync if last > 0 else None
        try:
            for index, batch in enumerate(batches):
                if switch_sync is not None:
                    switch_sync(index == last)
                with self._range(FORWARD), self.autocast():
                    output = self._unit(batch)
                loss, batch_targets = _check_unit_output(output, step_nr, counted_targets)
                counted_targets = batch_targets is not None
                losses.append(loss.detach())
                num_targets += 1 if batch_targets is None else batch_targets
                num_examples += _num_examples(batch)
                if index == last:
                    # Everything the totals need is known now: their all-reduce overlaps the
                    # last backward (and DDP's gradient reduction within it).
                    self._totals.start(
                        num_targets=num_targets,
                        num_examples=num_examples,
                        stop_requested=stop_requested,
                        losses=losses,
                    )
                with self._range(BACKWARD):
                    torch.autograd.backward(loss if loss_scale == 1.0 else loss * loss_scale)
        finally:
            if switch_sync is not None:
                switch_sync(True)
        return losses, num_targets, loss

    def _normalize_gradients(
        self, scaled_total_targets: float, measure_grad_norm: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """Normalize (dividing by the targets of the step times the loss scale), and clip with
        ``max_gradient_norm``; return the non-finite flag and the gradient norm, measured when
        ``measure_grad_norm`` or clipping."""
        # DDP and FSDP average gradients over the DP gang; this turns the average of per-rank
        # sums into the sum over all targets divided by their count.
        non_finite = self._gradients.normalize(self._dp_size / scaled_total_targets)
        max_norm = self._max_gradient_norm
        if not measure_grad_norm and max_norm is None:
            return non_finite, None
        grad_norm = self._gradients.norm()
        if max_norm is not None:
            self._gradients.clip(max_norm, grad_norm)
        return non_finite, grad_norm

    def _update_model(self, applied: bool, may_skip: bool) -> None:
        # Every optimizer steps, or none does: a skipped step skips them together.
        if applied:
            with _scaled_learning_rates(self.optimizers, self.lr_scale):
                for optimizer in self.optimizers:
                    optimizer.step()
        if may_skip:
            if applied:
                self._unit.metric_bag.commit_updates()
            else:
                self._unit.metric_bag.rollback_updates()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for scheduler in self._lr_schedulers:
            scheduler.step()

    def clear_non_finite(self) -> None:
        """Forget a non-finite gradient: the weights were reloaded from before it."""
        self._gradients.clear_non_finite()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The unit's forward context: autocast to ``dtype`` with ``amp``, nothing otherwise."""
        if not self._autocasts:
            return _NO_AUTOCAST
        return torch.autocast(device_type=self._gangs.dp.device.type, dtype=self._dtype)

    @property
    def traces(self) -> bool:
        """Whether the step marks its ranges for a profiler."""
        return self._trace

    def learning_rates(self) -> dict[str, float]:
        """The learning rate of every optimizer's every parameter group: ``lr`` for the first
        group of the first optimizer, ``lr/opt{i}/group{j}`` for the others (both from 0)."""
        rates = {}
        for i, optimizer in enumerate(self.optimizers):
            for j, group in enumerate(optimizer.param_groups):
                rates["lr" if i == j == 0 else f"lr/opt{i}/group{j}"] = float(group["lr"])
        return rates

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale, or None without fp16."""
        return self._loss_scaler.scale if self._loss_scaler.enabled else None

    def state_dict(self) -> dict[str, Any]:
        # One scheduler's state is kept as it was before several were allowed, so checkpoints
        # of either kind load; several are a list in their order.
        states = [scheduler.state_dict() for scheduler in self._lr_schedulers]
        return {
            "loss_scaler": self._loss_scaler.state_dict(),
            "lr_scheduler": None if not states else states[0] if len(states) == 1 else states,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(state, {"loss_scaler", "lr_scheduler"}, what="train_step")
        self._loss_scaler.load_state_dict(state["loss_scaler"])
        saved = state["lr_scheduler"]
        states = [] if saved is None else list(saved) if isinstance(saved, list) else [saved]
        if not self._lr_schedulers and states:
            log.warning(
                "The checkpoint holds an LR scheduler state, but this Trainer has no "
                "lr_scheduler; the learning rate stays the optimizer's."
            )
            return
        if len(states) != len(self._lr_schedulers):
            raise TrainerError(
                f"This Trainer has {len(self._lr_schedulers)} LR scheduler(s), but the checkpoint "
                f"holds the state of {len(states)} (its run had that many). Resume with the "
                "schedulers of that run, or start a fresh run."
            )
        for scheduler, scheduler_state in zip(self._lr_schedulers, states, strict=True):
            scheduler.load_state_dict(scheduler_state)


_NO_AUTOCAST: Final = contextlib.nullcontext()


def as_optimizers(optimizer: Optimizer | Sequence[Optimizer]) -> list[Optimizer]:
    """The Trainer's ``optimizer``, one or several, as a list; an error for anything else."""
    optimizers = [optimizer] if isinstance(optimizer, Optimizer) else list(optimizer)
    if not optimizers or not all(isinstance(o, Optimizer) for o in optimizers):
        raise ValueError(
            "optimizer must be a torch.optim.Optimizer or a non-empty sequence of them, but is "
            f"{_describe(optimizer)} instead."
        )
    seen: set[int] = set()
    for o in optimizers:
        for group in o.param_groups:
            for param in group["params"]:
                if id(param) in seen:
                    raise ValueError(
                        "A parameter is in more than one of the optimizers (or twice in one), "
                        "so it would be updated more than once per step. Give each optimizer "
                        "its own parameters."
                    )
                seen.add(id(param))
    return optimizers


def _as_schedulers(
    lr_scheduler: LRScheduler | Sequence[LRScheduler] | None,
) -> list[LRScheduler]:
    if lr_scheduler is None:
        return []
    if isinstance(lr_scheduler, LRScheduler):
        return [lr_scheduler]
    schedulers = list(lr_scheduler)
    if not all(isinstance(s, LRScheduler) for s in schedulers):
        raise ValueError(
            "lr_scheduler must be an LRScheduler, a sequence of them, or None, but is "
            f"{_describe(lr_scheduler)} instead."
        )
    return schedulers


@contextlib.contextmanager
def _scaled_learning_rates(optimizers: Sequence[Optimizer], scale: float) -> Iterator[None]:
    """Every parameter group's learning rate times ``scale`` within the block, as before after."""
    if scale == 1.0:
        yield
        return
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    rates = [group["lr"] for group in groups]
    for group, lr in zip(groups, rates, strict=True):
        group["lr"] = lr * scale
    try:
        yield
    finally:
        for group, lr in zip(groups, rates, strict=True):
            group["lr"] = lr


def _check_unit_output(
    output: object, step_nr: int, counted_targets: bool | None
) -> tuple[Tensor, int | None]:
    """The unit's ``(loss, num_targets)``, or an error that names the step and the fix.

    ``counted_targets`` says whether the unit returned a target count for the step's micro-batches
    before this one (None for the first): it must not change its mind within a step.
    """
    fix = (
        "A TrainUnit returns (loss, num_targets): the loss summed over the batch's targets as a "
        "0-dim tensor that depends on the model, and their count as an int (None if the loss "
        "is a mean)."
    )
    if not isinstance(output, tuple) or len(output) != 2:
        raise TrainerError(f"The unit returned {_describe(output)} at step {step_nr}. {fix}")
    loss, num_targets = output
    if not isinstance(loss, Tensor):
        raise TrainerError(
            f"The unit returned a loss of {_describe(loss)} at step {step_nr}. {fix}"
        )
    if loss.dim() != 0:
        raise TrainerError(
            f"The unit returned a loss of shape {tuple(loss.shape)} at step {step_nr}; it must be "
            f"a 0-dim tensor: sum it (reduction='sum'). {fix}"
        )
    if not loss.requires_grad:
        raise TrainerError(
            f"The unit returned a loss without grad at step {step_nr}: it does not depend on the "
            "model's parameters (computed under torch.no_grad() or inference_mode, or detached, "
            "or the model's parameters do not require grad)."
        )
    if num_targets is None:
        if counted_targets:
            raise _changed_its_mind(step_nr)
        return loss, None
    # A plain int passes on the first test; bool is an int, but True is no count.
    if type(num_targets) is not int and (
        not isinstance(num_targets, int) or isinstance(num_targets, bool)
    ):
        raise TrainerError(
            f"The unit returned a target count of {_describe(num_targets)} at step {step_nr}; it "
            "must be an int (for a tensor, .numel() of the targets, or int(mask.sum()))."
        )
    if num_targets < 0:
        raise TrainerError(
            f"The unit returned {num_targets} targets at step {step_nr}; a count must be zero or "
            "more."
        )
    if counted_targets is False:
        raise _changed_its_mind(step_nr)
    return loss, num_targets


def _changed_its_mind(step_nr: int) -> TrainerError:
    return TrainerError(
        f"The unit returned a target count for some micro-batches of step {step_nr} and None for "
        "others. Return one or the other for every batch."
    )


def _describe(value: object) -> str:
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def _num_examples(batch: object) -> int:
    """Examples in a micro-batch: ``batch.batch_size`` if it has one; for what ``default_collate``
    makes (a list, tuple or dict whose tensors share their first dimension), that dimension;
    else ``len(batch)``. A list of per-example tensors of one length reads as that length: such
    a batch should say its ``batch_size``."""
    size = getattr(batch, "batch_size", None)
    if isinstance(size, int):
        return size
    shared = None
    if isinstance(batch, (list, tuple)):
        shared = _shared_first_dim(batch)
    elif isinstance(batch, Mapping):
        shared = _shared_first_dim(batch.values())
    if shared is not None:
        return shared
    try:
        return len(batch)  # type: ignore[arg-type]
    except TypeError:
        return 0


def _shared_first_dim(fields: Iterable[object]) -> int | None:
    """The first dimension the tensors among ``fields`` share, or None if they do not."""
    shared: int | None = None
    for field in fields:
        shape = field.shape if isinstance(field, Tensor) else None
        if shape:
            if shared is not None and shape[0] != shared:
                return None
            shared = shape[0]
    return shared
