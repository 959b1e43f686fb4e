"""Pipeline parallelism: a rank's stages and the schedule that runs them, over ``Gangs.pp``.

The stages are torch's ``PipelineStage`` (:class:`~runtime.parallel.pipeline_stage.Stage`: synced
once per step, forward-only under every schedule) and the schedules torch's own
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
from gangs.torch_versions import private_apis_refused, private_apis_supported
from runtime.parallel.pipeline_ties import StageTies
from units.pipeline import StageInputs, set_inferring_shapes

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

_REPLICA: Final = "_pipeline_data_parallel_wrapper"
"""The attribute of a stage that holds its DDP wrapper, kept out of the stage's submodules so
that the stage's (and the part's) names stay the whole model's."""


def set_data_parallel_stage(stage: Module, wrapper: Module) -> None:
    """Have :class:`Pipeline` run ``stage`` through ``wrapper``, its DDP over the stage's DP gang
    (:func:`~runtime.parallel.parallelize.parallelize_model` makes it); the rank's part keeps
    the unwrapped modules, so the optimizer and the checkpoints see the whole model's names."""
    # Not setattr: nn.Module would make the wrapper a submodule of the module it wraps, a
    # cycle that named_modules and state_dict would walk.
    stage.__dict__[_REPLICA] = wrapper


def data_parallel_stage(stage: Module) -> Module:
    """The module the pipeline runs for ``stage``: its DDP wrapper if it has one, else itself
    (sharded in place by FSDP2, or alone on its DP gang)."""
    wrapper = stage.__dict__.get(_REPLICA, stage)
    assert isinstance(wrapper, Module)
    return wrapper


def _check_replicated_stages(schedule: str, modules: Sequence[Module]) -> None:
    """Refuse DDP stages under the schedules that split the backward: their weight gradients
    are computed apart (``autograd.grad``) and never reach DDP's hooks, so DP ranks would drift
    apart."""
    from torch.nn.parallel import DistributedDataParallel

    if schedule in _V_SHAPED and any(isinstance(m, DistributedDataParallel) for m in modules):
        raise ValueError(
            f"pipeline.schedule={schedule} computes weight gradients apart from the backward, "
            "which DDP cannot all-reduce over the DP ranks of a stage. Use data_parallel=fsdp "
            "(kind='fsdp'), or pipeline.schedule=1f1b or interleaved_1f1b."
        )


def _keep_sharded_stages_gathered(schedule: str, modules: Sequence[Module]) -> None:
    """Keep FSDP2's gathered parameters from each forward to the backward under the schedules
    that split it. Their input-gradient action (I) finds the weights it leaves to the
    weight-gradient action (W) among the stage's parameters as registered when it starts: a
    layer resharded after its forward is registered by its shards, which the forward's graph
    never used, so W would skip that layer's gradients. The stage's gradient sync reshards."""
    from torch.distributed.fsdp import FSDPModule

    if schedule not in _V_SHAPED:
        return
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(False)


@final
class Pipeline:
    """A rank's stages of a model and the schedule that runs them.

    ``stages`` are the modules of ``ids`` (:func:`stage_ids`), ``part`` the rank's module over
    all of them (what the unit trains and the checkpoints hold). :meth:`step` runs one batch
    forward and backward, :meth:`eval` forward only (under every schedule); the last stage keeps
    the summed loss of each microbatch. A tie that the first and the last stage hold on
    different ranks (tied embeddings) is a copy on each, kept equal by :attr:`ties`.
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
        from runtime.parallel.pipeline_stage import Stage

        pp = gangs.pp
        if not isinstance(pp, ProcessGroupGang):
            raise ValueError("A pipeline needs a PP gang of two or more processes (pp_size).")
        _check_placement(schedule, pp, ids, num_microbatches)
        self.part = part
        self.num_stages = pp.size * len(stages)
        self.num_microbatches = num_microbatches
        self.has_first = 0 in ids
        self.has_last = self.num_stages - 1 in ids
        self.schedule_name = schedule
        self.last_stage_rank = 0 if schedule in _V_SHAPED else pp.size - 1
        """The PP rank of the last stage, which holds the losses."""
        self._loss_fn: LossFn | None = None
        self._shapes: object = None
        self.ties = StageTies(part=part, gangs=gangs, last_stage_rank=self.last_stage_rank)
        """The copies of tied weights whose holders are this stage and one on another rank."""
        self._inferring: set[object] = set()
        """The stages (and the loss: ``self``) whose next call only infers shapes."""
        self._mode: str | None = None
        """The kind of the last run (step or eval) since the stages last inferred shapes."""
        group = pp.as_process_group()
        modules = [data_parallel_stage(module) for module in stages]
        _check_replicated_stages(schedule, modules)
        _keep_sharded_stages_gathered(schedule, modules)
        self._stages = [
            Stage(module, stage_id, self.num_stages, gangs.root.device, group=group)
            for module, stage_id in zip(modules, ids, strict=True)
        ]
        self.stage_modules = list(stages)
        for module in stages:
            module.register_forward_pre_hook(self._begin_forward)
            module.register_forward_hook(self._end_forward, always_call=True)
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
        inferring = self in self._inferring
        self._inferring.discard(self)
        set_inferring_shapes(inferring)
        try:
            return self._loss_fn(output, target)
        finally:
            set_inferring_shapes(False)

    def _begin_forward(self, module: Module, args: Any) -> None:
        set_inferring_shapes(module in self._inferring)
        self._inferring.discard(module)

    def _end_forward(self, module: Module, args: Any, output: Any) -> None:
        set_inferring_shapes(False)

    def _infers_shapes(self, mode: str) -> bool:
        """Whether torch's next run (``mode``: step or eval) first infers the activations'
        shapes with real tensors: one forward of each stage, and for a step the last stage's
        loss, before the microbatches'. torch 2.13 does at the first run, after the shapes
        change (:meth:`_forget_shapes`) and after a switch between step and eval."""
        infers = self._mode != mode
        self._mode = mode
        return infers

    def step(
        self, inputs: StageInputs, loss_fn: LossFn, *, sync_gradients: bool = True
    ) -> Tensor | None:
        """Forward and backward of one batch; on the rank of the last stage, the sum of the
        microbatches' losses (detached), None elsewhere.

        ``sync_gradients``: whether the stages' DP gradients (DDP's, FSDP2's) are synced at its
        end. Under gradient accumulation only the step's last micro-batch syncs them; the
        others add to the unsynced gradients (see :mod:`runtime.parallel.pipeline_stage`)."""
        for stage in self._stages:
            stage.sync_gradients = sync_gradients
        return self._run(inputs, loss_fn, "step")

    def eval(self, inputs: StageInputs, loss_fn: LossFn) -> Tensor | None:
        """Forward only; as :meth:`step`."""
        with torch.no_grad():
            return self._run(inputs, loss_fn, "eval")

    def _run(self, inputs: StageInputs, loss_fn: LossFn, mode: str) -> Tensor | None:
        self.ties.sync_weights()
        inputs = self._padded(inputs)
        shapes = _shapes(inputs)
        if self._shapes is not None and shapes != self._shapes:
            self._forget_shapes(shapes)
        self._shapes = shapes
        self._loss_fn = loss_fn
        # What the stages (and a step's loss) compute only to infer shapes counts for nothing
        # (units.pipeline.inferring_shapes).
        inferring = {*self.stage_modules, *([self] if mode == "step" else [])}
        self._inferring = inferring if self._infers_shapes(mode) else set()
        run = self._schedule.step if mode == "step" else self._schedule.eval
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
            self._inferring = set()
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
        batch, and keeps private flags of it: they are reset only where the private APIs are
        used (:mod:`gangs.torch_versions`) and the schedule has them; elsewhere the change is
        refused."""
        schedule = self._schedule
        flags = (
            ("_stage_forward_initialized", "_stage_backward_initialized")
            if hasattr(schedule, "_stage_forward_initialized")
            else ("_stages_forward_initialized", "_stages_backward_initialized")
        )
        private = private_apis_supported()
        if not private or not all(hasattr(schedule, flag) for flag in flags):
            why = (
                f"its flags of them are private, {private_apis_refused()}"
                if not private
                else f"torch {torch.__version__} has no flags of them"
            )
            raise ValueError(
                f"The batch's shapes {shapes} differ from the last batch's {self._shapes}, and "
                f"torch's pipeline cannot change them ({why}). Give batches of one shape (drop "
                "the last partial batch)."
            )
        for flag in flags:
            setattr(schedule, flag, False)
        self._mode = None


def _check_placement(
    schedule: str, pp: ProcessGroupGang, ids: Sequence[int], num_microbatches: int
) -> None:
    """Refuse a pipeline that cannot run, or stages ``ids`` that are not the ones the schedule
    places on this PP rank."""
    check_pipeline(
        schedule, pp_size=pp.size, stages_per_rank=len(ids), num_microbatches=num_microbatches
    )
    expected = stage_ids(schedule, pp_rank=pp.rank, pp_size=pp.size, stages_per_rank=len(ids))
    if list(ids) != expected:
        raise ValueError(
            f"PP rank {pp.rank} holds stages {expected} under {schedule}, but was given "
            f"{list(ids)}."
        )


def _shapes(inputs: StageInputs) -> object:
    """The shapes of a batch's inputs, which the stages' buffers are sized by."""
    return (
        tuple(arg.shape for arg in inputs.args),
        tuple((name, value.shape) for name, value in sorted(inputs.kwargs.items())),
        inputs.target.shape,
    )
