"""A step's totals over the ranks: target and example counts, stop requests, non-finite losses.

The normalization needs the targets of the whole DP gang, and every rank must stop at the same
step, so a step sums four numbers over the ranks: one asynchronous all-reduce on CPU, started
before the last backward and waited for after it, so it overlaps the backward (and the gradient
reduction of DDP or FSDP within it). The numbers stay on CPU: reading them off a GPU would make
the host wait for the backward every step.
"""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from gangs import Gangs, PendingCollective, ReduceOperation


@final
class StepTotals:
    """Sums each step's target and example counts, stop requests and non-finite losses over all
    ranks: :meth:`start` before the step's last backward, :meth:`wait` after it. One per
    :class:`~runtime.training.step.TrainStep`, for the whole run.

    The sums run over the root gang; TP ranks (and PP ranks) of one DP rank see the same batch,
    so they count each of them ``tp.size * pp.size`` times, which :meth:`wait` divides out. SP
    ranks see the same examples too, but each counts only the targets of its part of the
    sequences: their examples are divided by ``sp.size`` as well, their targets are not.
    """

    def __init__(self, *, gangs: Gangs, check_losses: bool) -> None:
        self.loss_finite_here = True
        """Whether this rank's losses of the last step started were finite (checked only with
        ``check_losses``)."""
        self._root_gang = gangs.root
        # TP and PP ranks of one DP rank count the same batch; SP ranks the same examples, but
        # each only the targets of its part of the sequences.
        self._target_copies = gangs.tp.size * gangs.pp.size
        self._example_copies = self._target_copies * gangs.sp.size
        self._check_losses = check_losses
        self._values: list[float] = []
        self._tensor: Tensor | None = None
        self._pending: PendingCollective | None = None

    def start(
        self, *, num_targets: int, num_examples: int, stop_requested: bool, losses: list[Tensor]
    ) -> None:
        """Start summing over the ranks."""
        # With nan_policy="skip" every rank must know whether any rank's loss was finite: a
        # CPU-GPU sync point, which that policy pays every step.
        loss_finite = not self._check_losses or bool(torch.isfinite(torch.stack(losses)).all())
        self.loss_finite_here = loss_finite
        self._values = [num_targets, num_examples, float(stop_requested), float(not loss_finite)]
        if self._root_gang.size > 1:  # one rank has nothing to sum
            # On the CPU whatever the default device: gloo sums it, and reading it never waits
            # for the GPU.
            self._tensor = torch.tensor(self._values, dtype=torch.float64, device="cpu")
            self._pending = self._root_gang.all_reduce_async(self._tensor, ReduceOperation.SUM)

    def wait(self) -> tuple[float, float, float, float]:
        """Targets and examples of the DP gang, stop votes and non-finite-loss votes."""
        if self._pending is not None and self._tensor is not None:
            self._pending.wait()
            self._values = self._tensor.tolist()
            self._pending = self._tensor = None
        targets, examples, stops, non_finite = self._values
        return (
            targets / self._target_copies,
            examples / self._example_copies,
            stops,
            non_finite,
        )
