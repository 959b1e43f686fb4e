"""torch's ``PipelineStage`` with two changes: its data-parallel gradient sync waits for the
optimizer step's last micro-batch, and it runs forward only under the V-shaped schedules too.

**Sync once per step.** torch's ``PipelineStage`` syncs a stage's gradients over its DP gang at the end of every
``schedule.step``: DDP all-reduces in the backward of the last pipeline microbatch
(``backward_maybe_with_nosync`` with ``last_backward``), FSDP2 reduce-scatters in
``perform_reduce_grad``. Under gradient accumulation a step runs one ``schedule.step`` per
micro-batch, so the same sums would cross the network once per micro-batch. With
:attr:`Stage.sync_gradients` false, both public methods leave the gradients to
accumulate locally (DDP under ``no_sync``, FSDP2 unsharded, as between the microbatches of one
``schedule.step``), and the step's last ``schedule.step`` syncs the sum once.

**Forward only under zbv and dualpipev.** Their forward-only run (``schedule.eval``) still walks
the backward actions of the step it was planned for, and where two adjacent stages share a rank
it hands the gradient of one stage's input to the other, which a stage without backward
refuses. In a forward-only run there is no gradient to hand over: the stage hands over nothing.
With backward, or under the other schedules (no adjacent stages on a rank), it is torch's.

Imported only with a pipeline: ``torch.distributed.pipelining`` takes a while to import.
"""

from __future__ import annotations

from typing import Any, cast, final

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel


@final
class Stage(PipelineStage):
    """``PipelineStage`` that syncs its DP gradients only in a ``schedule.step`` run with
    :attr:`sync_gradients`, and runs forward only under every schedule (see the module
    docstring).

    Where the installed torch's schedules reduce FSDP2's gradients in a private post-backward
    rather than ``perform_reduce_grad`` (an older torch), FSDP2 syncs at every
    ``schedule.step`` as before: the same gradients, more communication.
    :data:`SYNCS_ONCE_WITH_FSDP` says which.
    """

    sync_gradients: bool = True
    """Whether the next ``schedule.step`` is the optimizer step's last micro-batch."""

    def __init__(self, submodule: Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, *args, **kwargs)
        if isinstance(submodule, DistributedDataParallel):
            # torch infers the stages' shapes by calling the module itself, outside no_sync: a
            # DDP forward there arms its reducer, and the next backward, a microbatch's that
            # should accumulate, would all-reduce (and DDP's first bucket rebuild would count
            # the parameters twice: an internal assert at a later forward). So no forward
            # arms it; the backward torch marks last arms it itself.
            submodule.require_backward_grad_sync = False

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        # DDP all-reduces in the backward torch marks last, unless no_sync: only the step's.
        return super().backward_maybe_with_nosync(
            backward_type, bwd_kwargs, last_backward=last_backward and self.sync_gradients
        )

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.sync_gradients or not isinstance(self.submod, FSDPModule):
            super().perform_reduce_grad(grad_scale_factor)
            return
        # FSDP2 kept each backward's gradient unsharded (requires_gradient_sync off) and the
        # parameters gathered, as it does between the microbatches of one schedule.step: the
        # next micro-batch adds to them and the last one reduce-scatters the sum. The pipeline
        # is built with scale_grads=False, so there is nothing to scale.
        if grad_scale_factor != 1:
            raise ValueError(
                "A pipeline that syncs gradients once per step sums its losses "
                f"(scale_grads=False), but was asked to scale them by {grad_scale_factor}."
            )

    def get_local_bwd_output(self, mb_index: int) -> Any:
        if not self.has_backward:
            return ()
        # torch leaves the method untyped.
        return cast(Any, super()).get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


SYNCS_ONCE_WITH_FSDP: bool = hasattr(PipelineStage, "perform_reduce_grad")
"""Whether the installed torch's schedules reduce FSDP2's gradients through the public
``perform_reduce_grad`` that :class:`Stage` overrides (else once per ``schedule.step``);
DDP's ``backward_maybe_with_nosync`` is there on every supported torch."""
