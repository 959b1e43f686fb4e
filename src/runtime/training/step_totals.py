"""A step's totals over the ranks: target and example counts, stop requests, non-finite losses.

The normalization needs the targets of the whole DP gang, and every rank must stop at the same
step, so a step sums four numbers over the ranks. They go in one asynchronous all-reduce on CPU
that overlaps the last backward. Under DDP on CPU they ride in DDP's first gradient bucket
instead (:class:`DdpCountCarrier`), so they cost no collective of their own: there the two
all-reduces would share the same cores and transport. On GPUs they stay on CPU, since reading
them off a GPU bucket would make the host wait for the backward every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

import torch
from torch import Tensor
from torch.nn import Module

from gangs import Gangs, PendingCollective, ReduceOperation
from runtime.training.gradients import loaded_class

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
    from torch.distributed import ProcessGroup
    from torch.futures import Future

# A count travels as two digits in this base: a float32 sum of the low digits of up to
# _MAX_CARRIER_RANKS ranks stays below 2**24, so it is exact, and so is the sum of the high
# digits of any count below 2**36 (more targets than one rank can hold in a step).
_DIGIT_BASE = 4096
_MAX_CARRIER_RANKS = 4096

# The number of values in a step's totals: targets, examples, stop votes, non-finite votes.
_NUM_TOTALS = 4


@final
class StepTotals:
    """Sums each step's target and example counts, stop requests and non-finite losses over all
    ranks: :meth:`start` before the step's last backward, :meth:`wait` after it. One per
    :class:`~runtime.training.step.TrainStep`, for the whole run.

    The sums run over the root gang; TP ranks of one DP rank see the same batch, so they count
    each of them ``tp.size`` times, which :meth:`wait` divides out.
    """

    def __init__(
        self, *, gangs: Gangs, check_losses: bool, carrier: DdpCountCarrier | None
    ) -> None:
        self.loss_finite_here = True
        """Whether this rank's losses of the last step started were finite (checked only with
        ``check_losses``)."""
        self._root_gang = gangs.root
        self._num_ranks = gangs.root.size
        self._tp_size = gangs.tp.size
        self._check_losses = check_losses
        self._carrier = carrier
        self._values: list[float] = []
        self._tensor: Tensor | None = None
        self._pending: PendingCollective | None = None

    def start(
        self, *, num_targets: int, num_examples: int, stop_requested: bool, losses: list[Tensor]
    ) -> None:
        """Start summing, before the last backward: under DDP it carries the sums."""
        # With nan_policy="skip" every rank must know whether any rank's loss was finite: a
        # CPU-GPU sync point, which that policy pays every step.
        loss_finite = not self._check_losses or bool(torch.isfinite(torch.stack(losses)).all())
        self.loss_finite_here = loss_finite
        self._values = [
            float(num_targets),
            float(num_examples),
            float(stop_requested),
            float(not loss_finite),
        ]
        if self._num_ranks == 1:
            return
        if self._carrier is not None:
            self._carrier.send(self._values)
        else:
            self._tensor = torch.tensor(self._values, dtype=torch.float64)
            self._pending = self._root_gang.all_reduce_async(self._tensor, ReduceOperation.SUM)

    def wait(self) -> tuple[float, float, float, float]:
        """Targets and examples of the DP gang, stop votes and non-finite-loss votes."""
        values = self._values
        if self._carrier is not None:  # attached only where the root gang has several ranks
            received = self._carrier.receive()
            if received is None:
                # DDP did not reduce gradients in this step's backward, so nothing carried the
                # totals: every rank is in the same case, and sums them the plain way.
                tensor = torch.tensor(values, dtype=torch.float64)
                self._root_gang.all_reduce(tensor, ReduceOperation.SUM)
                received = tensor.tolist()
            values = received
        elif self._pending is not None and self._tensor is not None:
            self._pending.wait()
            values = self._tensor.tolist()
            self._pending = self._tensor = None
        targets, examples, stops, non_finite = values
        return targets / self._tp_size, examples / self._tp_size, stops, non_finite


@final
class DdpCountCarrier:
    """Carries a step's totals in DDP's gradient all-reduce, as a communication hook.

    The hook does what DDP does without one (scale each bucket by ``1 / world size``, all-reduce
    it), and appends the totals to bucket 0's all-reduce, taking their sums off its result. So
    under DDP a step makes no collective but DDP's own, and the totals arrive with the gradients.
    Bucket 0 is the first one ready in backward and DDP keeps it small (1 MB), so appending to it
    copies little.
    """

    def __init__(self, *, process_group: ProcessGroup, group_size: int) -> None:
        self._process_group = process_group
        self._group_size = group_size
        self._outgoing: Tensor | None = None
        self._received: list[float] | None = None

    @staticmethod
    def attach(model: Module, gangs: Gangs) -> DdpCountCarrier | None:
        """Register the carrier on ``model`` if it is DDP that can carry the totals, else None.

        It does not when the root gang is not DDP's (tensor parallelism), when the parameters
        are not on CPU (see the module's docstring), when the gradients are not float32 or
        float64 (float16 and bfloat16 do not hold the counts exactly), or when the model has a
        communication hook already (DDP takes one).
        """
        ddp = loaded_class("torch.nn.parallel", "DistributedDataParallel")
        if ddp is None or not isinstance(model, ddp):
            return None
        num_ranks = gangs.root.size
        if num_ranks == 1 or num_ranks != gangs.dp.size or num_ranks > _MAX_CARRIER_RANKS:
            return None
        if getattr(model, "_comm_hooks", None):
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        if not params or any(
            p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64) for p in params
        ):
            return None
        carrier = DdpCountCarrier(process_group=model.process_group, group_size=num_ranks)
        # A lambda: DDP compares the hook's annotations with its classes, and this module's
        # annotations are strings.
        model.register_comm_hook(carrier, lambda state, bucket: state.carry(bucket))
        return carrier

    def send(self, values: list[float]) -> None:
        """Give the totals of this rank to the next backward's bucket 0."""
        digits: list[float] = []
        for value in values:
            high, low = divmod(int(value), _DIGIT_BASE)
            digits += (float(high), float(low))
        self._outgoing = torch.tensor(digits, dtype=torch.float64)
        self._received = None

    def receive(self) -> list[float] | None:
        """The totals summed over the ranks, or None if no all-reduce carried them."""
        received, self._received = self._received, None
        self._outgoing = None
        return received

    def carry(self, bucket: GradBucket) -> Future[Tensor]:
        """DDP's communication hook: all-reduce ``bucket``, with the totals if it is bucket 0."""
        import torch.distributed as dist

        buffer = bucket.buffer()
        # DDP's own default multiplies by the reciprocal: the same bits as without a hook.
        buffer.mul_(1.0 / self._group_size)
        outgoing = self._outgoing if bucket.index() == 0 else None
        if outgoing is None:
            work = dist.all_reduce(buffer, group=self._process_group, async_op=True)
            assert work is not None
            reduced: Future[Tensor] = work.get_future().then(_first_tensor)
            return reduced

        self._outgoing = None
        size = buffer.numel()
        packed = torch.cat([buffer, outgoing.to(buffer.dtype)])
        work = dist.all_reduce(packed, group=self._process_group, async_op=True)
        assert work is not None

        def unpack(future: Future[Any]) -> Tensor:
            future.wait()
            digits = packed[size:].tolist()
            self._received = [
                digits[i] * _DIGIT_BASE + digits[i + 1] for i in range(0, 2 * _NUM_TOTALS, 2)
            ]
            return buffer.copy_(packed[:size])

        carried: Future[Tensor] = work.get_future().then(unpack)
        return carried


def _first_tensor(future: Future[Any]) -> Tensor:
    value: Tensor = future.value()[0]
    return value
