"""One optimizer step: forward and backward over the micro-batches, normalization, clipping,
loss scaling, the optimizer and the LR scheduler."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, final

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gangs import Gangs, ReduceOperation
from runtime.arguments import check_positive
from runtime.errors import TrainerError
from runtime.gradients import clip_gradient_norm, scale_gradients, skip_gradient_sync
from runtime.loss_scale import LossScaler
from runtime.train_state import check_state_keys
from units import TrainUnit

log = logging.getLogger(__name__)

BatchT = TypeVar("BatchT")


@final
@dataclass(frozen=True)
class StepOutput:
    """What one step measured; tensors stay on the device, so reading them is left to publish."""

    loss_sum: Tensor
    """This rank's summed loss (float64)."""
    num_targets: int
    """This rank's targets (or micro-batches, for a unit that returns mean losses)."""
    total_targets: float
    """The targets of the whole DP gang: the normalizer of the step."""
    total_examples: float
    """The examples of the whole DP gang."""
    grad_norm: Tensor
    """The gradient norm before clipping."""
    stop_requested: bool
    """Whether any rank asked to stop (a signal) before this step."""


@final
class TrainStep(Generic[BatchT]):
    """Runs ``unit`` over a step's micro-batches and updates the model with ``optimizer``.

    The gradients are scaled so that the update is the mean over all targets of the step, across
    gradient accumulation and the data-parallel gang: *sum of losses / total targets*.
    """

    def __init__(
        self,
        *,
        unit: TrainUnit[BatchT],
        optimizer: Optimizer,
        gangs: Gangs,
        lr_scheduler: LRScheduler | None = None,
        dtype: torch.dtype = torch.float32,
        amp: bool = False,
        fp16_loss_scale: tuple[float, float] = (128.0, 0.0001),
        max_gradient_norm: float | None = None,
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype must be torch.float32, torch.bfloat16 or torch.float16, but is {dtype} instead."
            )
        check_positive("max_gradient_norm", max_gradient_norm)
        self._unit = unit
        self._model = unit.model
        self._optimizer = optimizer
        self._lr_scheduler = lr_scheduler
        self._gangs = gangs
        self._dtype = dtype
        self._amp = amp
        self._max_gradient_norm = max_gradient_norm
        self._loss_scaler = LossScaler(
            init_scale=fp16_loss_scale[0],
            min_scale=fp16_loss_scale[1],
            enabled=dtype == torch.float16,
        )

    def __call__(self, batches: list[BatchT], *, step_nr: int, stop_requested: bool) -> StepOutput:
        self._unit.set_step_nr(step_nr)
        if self._loss_scaler.enabled:
            self._unit.metric_bag.begin_updates()

        loss_sum, num_targets, num_examples = self._forward_backward(batches, step_nr)

        # One CPU all-reduce per step, the one the normalization needs: the DP-wide target count.
        # A stop request rides along, so every rank stops at the same step at no extra cost.
        # TP ranks of one DP rank see the same batch, so the root-wide sum counts each tp.size times.
        totals = torch.tensor(
            [float(num_targets), float(num_examples), float(stop_requested)], dtype=torch.float64
        )
        self._gangs.root.all_reduce(totals, ReduceOperation.SUM)
        total_targets, total_examples = (totals[:2] / self._gangs.tp.size).tolist()
        if total_targets == 0:
            raise TrainerError(
                f"The batches of step {step_nr} have no targets on any data-parallel rank, so the "
                "loss cannot be normalized. Check that the data yields non-empty targets."
            )

        # DDP and FSDP average gradients over the DP gang; this turns the average of per-rank sums
        # into the sum over all targets divided by their count.
        scale = self._gangs.dp.size / (total_targets * self._loss_scaler.scale)
        scale_gradients(self._model, scale)
        grad_norm = clip_gradient_norm(self._model, self._max_gradient_norm)
        self._update(grad_norm, step_nr)
        return StepOutput(
            loss_sum=loss_sum,
            num_targets=num_targets,
            total_targets=total_targets,
            total_examples=total_examples,
            grad_norm=grad_norm,
            stop_requested=bool(totals[2] > 0),
        )

    def _forward_backward(self, batches: list[BatchT], step_nr: int) -> tuple[Tensor, int, int]:
        """Backpropagate each micro-batch's summed loss; return the loss sum and the counts."""
        loss_sum = torch.zeros((), device=self._gangs.dp.device, dtype=torch.float64)
        num_targets = 0
        num_examples = 0
        counted_targets: bool | None = None
        last = len(batches) - 1
        for index, batch in enumerate(batches):
            # DP gradient reduction waits for the last micro-batch.
            with skip_gradient_sync(self._model, index < last):
                with self.autocast():
                    loss, batch_targets = self._unit(batch)
                if counted_targets is None:
                    counted_targets = batch_targets is not None
                elif counted_targets != (batch_targets is not None):
                    raise TrainerError(
                        f"The unit returned a target count for some micro-batches of step {step_nr} "
                        "and None for others. Return one or the other for every batch."
                    )
                if batch_targets is not None and batch_targets < 0:
                    raise TrainerError(
                        f"The unit returned {batch_targets} targets at step {step_nr}; a count must "
                        "be zero or more."
                    )
                torch.autograd.backward(loss * self._loss_scaler.scale)
            loss_sum += loss.detach()
            num_targets += 1 if batch_targets is None else batch_targets
            num_examples += _num_examples(batch)
        return loss_sum, num_targets, num_examples

    def _update(self, grad_norm: Tensor, step_nr: int) -> None:
        if self._loss_scaler.update(grad_norm, step_nr):
            self._optimizer.step()
            if self._loss_scaler.enabled:
                self._unit.metric_bag.commit_updates()
        else:
            self._unit.metric_bag.rollback_updates()
        self._optimizer.zero_grad(set_to_none=True)
        if self._lr_scheduler is not None:
            self._lr_scheduler.step()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The unit's forward context: autocast to ``dtype`` with ``amp``, nothing otherwise."""
        if not self._amp or self._dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._gangs.dp.device.type, dtype=self._dtype)

    @property
    def learning_rate(self) -> float:
        """The learning rate of the first parameter group."""
        if self._lr_scheduler is not None:
            return float(self._lr_scheduler.get_last_lr()[0])
        return float(self._optimizer.param_groups[0]["lr"])

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale, or None without fp16."""
        return self._loss_scaler.scale if self._loss_scaler.enabled else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_scaler": self._loss_scaler.state_dict(),
            "lr_scheduler": None if self._lr_scheduler is None else self._lr_scheduler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(state, {"loss_scaler", "lr_scheduler"}, what="train_step")
        self._loss_scaler.load_state_dict(state["loss_scaler"])
        scheduler_state = state["lr_scheduler"]
        if self._lr_scheduler is None:
            if scheduler_state is not None:
                log.warning(
                    "The checkpoint holds an LR scheduler state, but this Trainer has no "
                    "lr_scheduler; the learning rate stays the optimizer's."
                )
        elif scheduler_state is None:
            raise TrainerError(
                "This Trainer has an lr_scheduler, but the checkpoint holds no LR scheduler state "
                "(its run had none). Resume without an lr_scheduler, or start a fresh run."
            )
        else:
            self._lr_scheduler.load_state_dict(scheduler_state)


def _num_examples(batch: object) -> int:
    """Examples in a micro-batch: ``batch.batch_size`` if it has one, else ``len(batch)``."""
    size = getattr(batch, "batch_size", None)
    if isinstance(size, int):
        return size
    try:
        return len(batch)  # type: ignore[arg-type]
    except TypeError:
        return 0
