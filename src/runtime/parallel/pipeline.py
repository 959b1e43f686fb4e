"""Pipeline parallelism: a rank's stages and the schedule that runs them, over ``Gangs.pp``.

The stages are ``torch.distributed.pipelining.PipelineStage`` and the schedules torch's own
(``pipeline.schedule``: :data:`SCHEDULES`), built with ``scale_grads=False``: units return
SUMMED losses and the Trainer divides the gradients by the step's targets, as without pipeline
parallelism. How a model splits into stages is the model's (:func:`models.pipeline.split_model`);
which stages a rank holds is the schedule's (:func:`stage_ids`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Final, Literal, final

import torch
from torch import Tensor
from torch.nn import Module

from gangs import Gangs, ProcessGroupGang
from units.pipeline import StageInputs

PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]

SCHEDULES: Final[dict[str, str]] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""``pipeline.schedule``'s names and the ``torch.distributed.pipelining`` class of each."""

_SINGLE: Final = ("gpipe", "1f1b")
"""The schedules of one stage per rank; the others hold several (looped or V-shaped)."""
_V_SHAPED: Final = ("zbv", "dualpipev")
"""Two stages per rank, the first and the last on rank 0: ``r`` and ``2 * pp_size - 1 - r``."""


def check_pipeline(
    schedule: str,
    *,
    pp_size: int,
    stages_per_rank: int,
    num_microbatches: int,
    batch_size: int | None = None,
) -> None:
    """Refuse, in one line naming the config keys, a pipeline that cannot run: an unknown
    schedule or one the installed torch lacks, a number of stages per rank the schedule does not
    take, fewer microbatches than it needs (which hangs or fails mid-step in torch), and a batch
    that the microbatches do not divide."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline.schedule must be one of {', '.join(SCHEDULES)}, but is '{schedule}'."
        )
    if _schedule_class(schedule) is None:
        raise ValueError(
            f"pipeline.schedule={schedule} needs torch.distributed.pipelining."
            f"{SCHEDULES[schedule]}, which torch {torch.__version__} lacks. Use 1f1b or "
            "interleaved_1f1b."
        )
    if num_microbatches < 1 or stages_per_rank < 1:
        raise ValueError(
            "pipeline.num_microbatches and pipeline.stages_per_rank must be at least 1, but are "
            f"{num_microbatches} and {stages_per_rank}."
        )
    if schedule in _SINGLE and stages_per_rank != 1:
        raise ValueError(
            f"pipeline.schedule={schedule} runs one stage per rank, but pipeline.stages_per_rank "
            f"is {stages_per_rank}. Use interleaved_1f1b for several, or stages_per_rank=1."
        )
    if schedule in _V_SHAPED and stages_per_rank != 2:
        raise ValueError(
            f"pipeline.schedule={schedule} runs exactly two stages per rank, but "
            f"pipeline.stages_per_rank is {stages_per_rank}. Set pipeline.stages_per_rank=2."
        )
    if schedule == "interleaved_1f1b" and stages_per_rank < 2:
        raise ValueError(
            "pipeline.schedule=interleaved_1f1b loops over several stages per rank, but "
            "pipeline.stages_per_rank is 1. Set it to 2 or more, or use 1f1b."
        )
    needed = pp_size * stages_per_rank if schedule in _V_SHAPED else pp_size
    if num_microbatches < needed:
        raise ValueError(
            f"pipeline.num_microbatches ({num_microbatches}) is fewer than the {needed} that "
            f"pipeline.schedule={schedule} needs with gang.pp_size={pp_size}: some stages would "
            f"wait forever. Use pipeline.num_microbatches={needed} or more."
        )
    rounds = max(1, num_microbatches // pp_size)
    if schedule == "interleaved_1f1b" and num_microbatches % rounds != 0:
        raise ValueError(
            f"pipeline.schedule=interleaved_1f1b runs the microbatches in rounds of "
            f"gang.pp_size ({pp_size}), but pipeline.num_microbatches ({num_microbatches}) is "
            f"no multiple of its {rounds} rounds. Use a multiple of {pp_size}."
        )
    if batch_size is not None and batch_size % num_microbatches != 0:
        raise ValueError(
            f"pipeline.num_microbatches ({num_microbatches}) must divide the batch size "
            f"({batch_size}): every microbatch has the same shape. Change either."
        )


def stage_ids(schedule: str, *, pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` of the PP gang holds, in order: ``pp_rank`` (and, looped, every
    ``pp_size``-th after it), or ``pp_rank`` and ``2 * pp_size - 1 - pp_rank`` for the V-shaped
    schedules."""
    if schedule in _V_SHAPED:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(stages_per_rank)]


def schedule_available(schedule: str) -> bool:
    """Whether the installed torch has the schedule ``schedule`` (one of :data:`SCHEDULES`)."""
    return _schedule_class(schedule) is not None


def _schedule_class(schedule: str) -> Any:
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[schedule], None)


LossFn = Callable[[Tensor, Tensor], Tensor]


@final
class Pipeline:
    """A rank's stages of a model and the schedule that runs them.

    ``stages`` are the modules of ``ids`` (:func:`stage_ids`), ``part`` the rank's module over
    all of them (what the unit trains and the checkpoints hold). :meth:`step` runs one batch
    forward and backward, :meth:`eval` forward only; the last stage keeps the summed loss of
    each microbatch.
    """

    def __init__(
        self,
        *,
        stages: Sequence[Module],
        part: Module,
        ids: Sequence[int],
        gangs: Gangs,
        schedule: str,
        num_microbatches: int,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        pp = gangs.pp
        if not isinstance(pp, ProcessGroupGang):
            raise ValueError("A pipeline needs a PP gang of two or more processes (pp_size).")
        stages_per_rank = len(stages)
        check_pipeline(
            schedule,
            pp_size=pp.size,
            stages_per_rank=stages_per_rank,
            num_microbatches=num_microbatches,
        )
        expected = stage_ids(
            schedule, pp_rank=pp.rank, pp_size=pp.size, stages_per_rank=stages_per_rank
        )
        if list(ids) != expected:
            raise ValueError(
                f"PP rank {pp.rank} holds stages {expected} under {schedule}, but was given "
                f"{list(ids)}."
            )
        self.part = part
        self.num_stages = pp.size * stages_per_rank
        self.num_microbatches = num_microbatches
        self.has_first = 0 in ids
        self.has_last = self.num_stages - 1 in ids
        self.schedule_name = schedule
        self.last_stage_rank = 0 if schedule in _V_SHAPED else pp.size - 1
        """The PP rank of the last stage, which holds the losses."""
        self._loss_fn: LossFn | None = None
        self._shapes: object = None
        group = pp.as_process_group()
        self._stages = [
            PipelineStage(module, stage_id, self.num_stages, gangs.root.device, group=group)
            for module, stage_id in zip(stages, ids, strict=True)
        ]
        cls = _schedule_class(schedule)
        first = self._stages if schedule not in _SINGLE else self._stages[0]
        self._schedule = cls(first, num_microbatches, loss_fn=self._loss, scale_grads=False)
        # Without it the last stage concatenates every microbatch's output (the logits) for
        # nothing; a torch whose step() lacks the switch concatenates them.
        self._step_options = (
            {"return_outputs": False}
            if "return_outputs" in inspect.signature(self._schedule.step).parameters
            else {}
        )

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        assert self._loss_fn is not None, "Pipeline.step sets the loss"
        return self._loss_fn(output, target)

    def step(self, inputs: StageInputs, loss_fn: LossFn) -> Tensor | None:
        """Forward and backward of one batch; on the rank of the last stage, the sum of the
        microbatches' losses (detached), None elsewhere."""
        return self._run(inputs, loss_fn, self._schedule.step)

    def check_evaluates(self) -> None:
        """Refuse validation where :meth:`eval` cannot run: torch's V-shaped schedules have no
        forward-only run."""
        if self.schedule_name in _V_SHAPED:
            raise ValueError(
                f"pipeline.schedule={self.schedule_name} cannot validate: torch's V-shaped "
                "schedules have no forward-only run. Use 1f1b or interleaved_1f1b, or leave "
                "out the valid set."
            )

    def eval(self, inputs: StageInputs, loss_fn: LossFn) -> Tensor | None:
        """Forward only; as :meth:`step`."""
        self.check_evaluates()
        with torch.no_grad():
            return self._run(inputs, loss_fn, self._schedule.eval)

    def _run(self, inputs: StageInputs, loss_fn: LossFn, run: Any) -> Tensor | None:
        inputs = self._padded(inputs)
        shapes = _shapes(inputs)
        if self._shapes is not None and shapes != self._shapes:
            self._forget_shapes(shapes)
        self._shapes = shapes
        self._loss_fn = loss_fn
        losses: list[Tensor] = []
        try:
            run(
                *inputs.args,
                target=inputs.target,
                losses=losses,
                **self._step_options,
                **inputs.kwargs,
            )
        finally:
            self._loss_fn = None
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    def _padded(self, inputs: StageInputs) -> StageInputs:
        """``inputs`` padded to a multiple of the microbatches (see
        :attr:`~units.pipeline.StageInputs.target_padding`), or refused in one line."""
        size = inputs.target.size(0)
        missing = -size % self.num_microbatches
        if missing == 0:
            return inputs
        if inputs.target_padding is None:
            raise ValueError(
                f"A batch of {size} examples does not split into pipeline.num_microbatches "
                f"({self.num_microbatches}) microbatches of one shape, and the unit gives no "
                "target_padding to fill it up with. Give batches of a multiple of it."
            )

        def pad(tensor: Tensor, fill: float | None = None) -> Tensor:
            rows = tensor[-1:].expand(missing, *tensor.shape[1:])
            if fill is not None:
                rows = torch.full_like(rows, fill)
            return torch.cat([tensor, rows])

        return replace(
            inputs,
            args=tuple(pad(arg) for arg in inputs.args),
            kwargs={name: pad(value) for name, value in inputs.kwargs.items()},
            target=pad(inputs.target, inputs.target_padding),
        )

    def _forget_shapes(self, shapes: object) -> None:
        """Make the stages infer their activations' shapes again at the next batch (its shape
        differs: a shorter last batch, or a valid set's). torch infers them once, at the first
        batch; the flags it keeps are private, so a torch without them refuses the change."""
        schedule = self._schedule
        flags = (
            ("_stage_forward_initialized", "_stage_backward_initialized")
            if hasattr(schedule, "_stage_forward_initialized")
            else ("_stages_forward_initialized", "_stages_backward_initialized")
        )
        if not all(hasattr(schedule, flag) for flag in flags):
            raise ValueError(
                f"The batch's shapes {shapes} differ from the last batch's {self._shapes}, and "
                f"torch {torch.__version__}'s pipeline cannot change them. Give batches of one "
                "shape (drop the last partial batch)."
            )
        for flag in flags:
            setattr(schedule, flag, False)


def _shapes(inputs: StageInputs) -> object:
    """The shapes of a batch's inputs, which the stages' buffers are sized by."""
    return (
        tuple(arg.shape for arg in inputs.args),
        tuple((name, value.shape) for name, value in sorted(inputs.kwargs.items())),
        inputs.target.shape,
    )
