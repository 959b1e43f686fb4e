"""One optimizer step under pipeline parallelism: :class:`TrainStep` with the forward and backward
of each micro-batch run by the pipeline's schedule.

Each of the step's micro-batches (gradient accumulation) is one ``schedule.step``, which splits
it into ``pipeline.num_microbatches`` and runs them through the stages; the last stage computes
each one's summed loss with the unit's :meth:`~units.pipeline.PipelineUnit.stage_loss`. Once per
step, the last stage's losses (one per micro-batch) are broadcast over the PP gang, so every rank
publishes the same loss and records the same metrics
(:meth:`~units.pipeline.PipelineUnit.record_loss`). Every stage reads the same batches, so each
knows the target count without asking; the gradient norm sums the squares of every stage's
gradients (:class:`~runtime.training.gradients.Gradients`). The update equals the one without
pipeline parallelism.
"""

from __future__ import annotations

from typing import Any, TypeVar, final

import torch
from torch import Tensor

from gangs import Gang
from runtime.errors import TrainerError
from runtime.metrics.tracing import FORWARD
from runtime.parallel.pipeline import Pipeline
from runtime.training.gradients import Gradients
from runtime.training.step import TrainStep, _num_examples
from units import EvalUnit, TrainUnit
from units.pipeline import PIPELINE_UNIT_HINT, PipelineUnit

BatchT = TypeVar("BatchT")


def pipeline_unit(unit: object, what: str) -> PipelineUnit[Any]:
    """``unit`` as a :class:`PipelineUnit`, or the one-line refusal (a ``ValueError``, which the
    recipes' command line reports as a refused config) of one that has not opted in."""
    if not isinstance(unit, PipelineUnit):
        raise ValueError(
            f"The {what} {type(unit).__name__} cannot run under pipeline parallelism "
            f"(gang.pp_size > 1): {PIPELINE_UNIT_HINT}."
        )
    return unit


@final
class PipelineTrainStep(TrainStep[BatchT]):
    """:class:`TrainStep` over a :class:`~runtime.parallel.pipeline.Pipeline` (see the module
    docstring)."""

    def __init__(self, *, pipeline: Pipeline, **kwargs: Any) -> None:
        unit: TrainUnit[BatchT] = kwargs["unit"]
        self._pipeline_unit = pipeline_unit(unit, "train unit")
        if unit.model is not pipeline.part:
            raise ValueError(
                "Under pipeline parallelism the unit trains this rank's part of the model: "
                "build it with models.pipeline.split_model and give the unit the part."
            )
        super().__init__(**kwargs)
        self._pipeline = pipeline
        self._pp_gang = kwargs["gangs"].pp
        uncounted = pipeline.ties.uncounted
        if uncounted:
            # The last stage's copy of a tied weight: the first stage's counts the tie once.
            self._gradients = Gradients(
                self._model,
                dp_gang=kwargs["gangs"].dp_sp,
                pp_gang=self._pp_gang,
                uncounted=uncounted,
            )

    def _forward_backward(
        self, batches: list[BatchT], step_nr: int, stop_requested: bool, loss_scale: float
    ) -> tuple[list[Tensor], int, Tensor]:
        unit = self._pipeline_unit
        scale = loss_scale

        def loss_fn(output: Tensor, target: Tensor) -> Tensor:
            loss = unit.stage_loss(output, target)
            return loss if scale == 1.0 else loss * scale

        num_targets = 0
        num_examples = 0
        sums: list[Tensor] = []
        aux_parts: list[Tensor] = []
        last = len(batches) - 1
        for index, batch in enumerate(batches):
            inputs = unit.stage_inputs(batch)
            if inputs.num_targets is None:
                # A mean per pipeline microbatch, summed over them, would weigh each batch by
                # its number of microbatches.
                raise TrainerError(
                    f"The unit gave no target count for a micro-batch of step {step_nr}. Under "
                    "pipeline parallelism stage_inputs gives num_targets and stage_loss a loss "
                    "summed over them."
                )
            num_targets += inputs.num_targets
            num_examples += _num_examples(batch)
            # The schedule interleaves the microbatches' forwards and backwards: one range.
            with self._range(FORWARD), self.autocast():
                # DP gradient sync waits for the last micro-batch, as without a pipeline.
                total = self._pipeline.step(inputs, loss_fn, sync_gradients=index == last)
            if total is not None:
                sums.append(total / scale if scale != 1.0 else total)
            aux_part = unit.stage_aux_loss()
            if aux_part is not None:
                aux_parts.append(aux_part)
        self._pipeline.ties.sum_gradients()
        losses, aux_losses = self._broadcast_losses(sums, aux_parts, len(batches))
        for i, (batch, loss) in enumerate(zip(batches, losses, strict=True)):
            if aux_losses:
                unit.record_loss(batch, loss - aux_losses[i])
                unit.record_aux_loss(batch, aux_losses[i])
            else:
                unit.record_loss(batch, loss)
        self._totals.start(
            num_targets=num_targets,
            num_examples=num_examples,
            stop_requested=stop_requested,
            losses=losses,
        )
        return losses, num_targets, losses[-1]

    def _broadcast_losses(
        self, sums: list[Tensor], aux_parts: list[Tensor], count: int
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The summed loss of each micro-batch and its auxiliary part (none without one), from
        the last stage to every PP rank: one broadcast per step."""
        device = self._pp_gang.device
        width = 2 if aux_parts else 1
        if sums:
            values = torch.stack(sums + aux_parts).to(device=device, dtype=torch.float32)
        else:
            values = torch.empty(width * count, dtype=torch.float32, device=device)
        self._pp_gang.broadcast(values, source_rank=self._pipeline.last_stage_rank)
        return list(values[:count].unbind()), list(values[count:].unbind())


@final
class PipelineEvalUnit(EvalUnit[Any]):
    """A valid unit run through the pipeline, forward only: the last stage computes each batch's
    summed loss (:meth:`~units.pipeline.PipelineUnit.stage_loss`), which is broadcast over the PP
    gang so that every rank records the same metrics. The Trainer wraps each valid unit in one
    under pipeline parallelism; its metric bag is the unit's own."""

    def __init__(self, unit: EvalUnit[Any], pipeline: Pipeline, pp_gang: Gang) -> None:
        super().__init__(pipeline.part, unit.display_name)
        self._unit = unit
        self._pipeline_unit = pipeline_unit(unit, "valid unit")
        self._pipeline = pipeline
        self._pp_gang = pp_gang
        self.metric_bag = unit.metric_bag

    def set_step_nr(self, step_nr: int) -> None:
        self._unit.set_step_nr(step_nr)

    def __call__(self, batch: Any) -> None:
        unit = self._pipeline_unit
        inputs = unit.stage_inputs(batch)
        total = self._pipeline.eval(inputs, unit.stage_loss)
        loss = (
            total.to(self._pp_gang.device, torch.float32).reshape(1)
            if total is not None
            else torch.empty(1, dtype=torch.float32, device=self._pp_gang.device)
        )
        self._pp_gang.broadcast(loss, source_rank=self._pipeline.last_stage_rank)
        unit.record_loss(batch, loss[0])
