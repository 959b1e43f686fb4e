"""Keeping a NaN or infinite loss or gradient norm out of the weights and the checkpoints.

Two policies:

- ``"error"`` (the default) costs no host-device sync per step. Each step's losses, and the flag
  the normalization of its gradients raises on a NaN or infinite gradient (see
  :meth:`runtime.training.gradients.Gradients.normalize`), stay on the device in the metric window; before
  every publish and every checkpoint the window is checked (one host read and one small
  all-reduce), and a non-finite value stops every rank with a :class:`NonFiniteError` naming the
  step, the rank and the value. No checkpoint is saved after the poisoned step, so the last
  checkpoint is from before it; the steps between the poisoned one and the check are lost, at
  most one publish interval.
- ``"skip"`` must decide before ``optimizer.step()`` whether to apply the update, so it reads
  on the host every step whether this rank's losses were finite (agreed over the ranks in the
  step's totals) and the gradient norm: two syncs per step, where fp16 loss scaling pays one.
  A skipped step leaves the weights and the optimizer state as they were, is counted in
  ``num_skipped_steps``, and more than ``max_consecutive_skipped_steps`` of them in a row stop
  the run with the same error.

With fp16 loss scaling the loss scaler owns non-finite gradients (an overflow skips the step and
halves the scale); the guard then watches the loss only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Final, Literal, final

import torch
from torch import Tensor

from gangs import Gang, ReduceOperation
from runtime.errors import NonFiniteError
from runtime.training.loss_spike import LossSpikeDetected, Spike, SpikeDetector
from trainkit_utils.arguments import check_positive

log = logging.getLogger(__name__)

NanPolicy = Literal["error", "skip"]

_NONE: Final = 2**40
"""The code of "no non-finite value" in the all-reduce that finds the first one."""


@final
class NonFiniteGuard:
    def __init__(
        self,
        *,
        policy: NanPolicy,
        max_consecutive_skipped_steps: int,
        root_gang: Gang,
        checks_gradients: bool,
    ) -> None:
        if policy not in ("error", "skip"):
            raise ValueError(f"nan_policy must be 'error' or 'skip', but is '{policy}' instead.")
        check_positive("max_consecutive_skipped_steps", max_consecutive_skipped_steps)
        self._policy = policy
        self._max_consecutive = max_consecutive_skipped_steps
        self._root_gang = root_gang
        self._checks_gradients = checks_gradients
        self._consecutive_skips = 0
        self.spikes: SpikeDetector | None = None
        """With a loss-spike guard, a non-finite value is a spike too: it rolls back (see
        :mod:`runtime.training.loss_spike`) instead of stopping."""

    @property
    def skips(self) -> bool:
        """Whether steps are checked on the host and skipped (``nan_policy="skip"``)."""
        return self._policy == "skip"

    def allows_step(
        self,
        *,
        step_nr: int,
        loss_finite_here: bool,
        losses_finite_everywhere: bool,
        grad_norm: Tensor,
    ) -> bool:
        """With ``"skip"``: whether the step may update the weights (the same on every rank).

        ``grad_norm`` is the same on every rank (it is computed from the reduced gradients), and
        ``losses_finite_everywhere`` was agreed in the step's all-reduce, so all ranks decide alike.
        """
        # A CPU-GPU sync point, the price of deciding before optimizer.step().
        norm_finite = not self._checks_gradients or bool(torch.isfinite(grad_norm))
        if losses_finite_everywhere and norm_finite:
            self._consecutive_skips = 0
            return True
        self._consecutive_skips += 1
        what = "gradient norm" if losses_finite_everywhere else "loss"
        if self._consecutive_skips > self._max_consecutive:
            raise NonFiniteError(
                f"The {what} was not finite at step {step_nr} {_where(loss_finite_here, what)}, "
                f"the {self._consecutive_skips}th step in a row (max_consecutive_skipped_steps is "
                f"{self._max_consecutive}): the training has diverged. Lower the learning rate, "
                "clip gradients (max_gradient_norm), or check the data of these steps."
            )
        log.warning(
            "The %s was not finite at step %d %s: skipped the update (%d in a row).",
            what,
            step_nr,
            _where(loss_finite_here, what),
            self._consecutive_skips,
        )
        return False

    def raise_if_non_finite(
        self,
        *,
        losses: Sequence[tuple[int, Tensor]],
        gradient_flag: Tensor | None,
        unchecked_steps: tuple[int, int] | None,
        num_targets: Mapping[int, int] | None = None,
    ) -> None:
        """With ``"error"``: stop every rank if a loss of the window, or a gradient of the
        ``unchecked_steps`` (first, last), was not finite. With a loss-spike guard, raise
        :class:`LossSpikeDetected` on every rank instead, also for a spike of a finite loss
        (each step's loss is its summed losses over its ``num_targets``).

        Every rank of the root gang must call it (one all-reduce). The losses and the flag
        (non-zero once a gradient was NaN or infinite) are this rank's.
        """
        if self.skips and self.spikes is None:
            return
        size, rank = self._root_gang.size, self._root_gang.rank
        checks_flag = self._checks_gradients and unchecked_steps is not None and not self.skips
        read, flagged = _read_window(losses, gradient_flag if checks_flag else None)
        pairs = zip(losses, read, strict=True)
        first_loss = next((s for (s, _), v in pairs if not math.isfinite(v)), _NONE)
        spike = (-1, math.nan, math.nan)
        if self.spikes is not None:
            spike = self.spikes.first_spike(_step_losses(losses, read, num_targets or {}))
        codes = torch.tensor(
            [
                first_loss * size + rank,
                rank if flagged else _NONE,
                (_NONE if spike[0] < 0 else spike[0]) * size + rank,
            ],
            dtype=torch.int64,
            device="cpu",
        )
        self._root_gang.all_reduce(codes, ReduceOperation.MIN)
        loss_code, flagged_rank, spike_code = codes.tolist()
        if self.spikes is not None:
            self._raise_spike(spike_code, flagged_rank < _NONE, unchecked_steps, spike[1:])
            return
        self._raise_non_finite(loss_code, flagged_rank, unchecked_steps)

    def _raise_spike(
        self,
        spike_code: int,
        flagged: bool,
        unchecked_steps: tuple[int, int] | None,
        loss_and_median: tuple[float, float],
    ) -> None:
        """Raise the spike the ranks agreed on: the first spike step, or the first unchecked
        step if a gradient was not finite (the flag says whether, not when)."""
        size = self._root_gang.size
        step_nr, spike_rank = divmod(spike_code, size) if spike_code < _NONE * size else (_NONE, -1)
        if flagged and unchecked_steps is not None and unchecked_steps[0] < step_nr:
            step_nr, spike_rank = unchecked_steps[0], -1
        if step_nr == _NONE:
            return
        # The rank that saw the spike tells the others its loss and median (one all-reduce,
        # only on a spike).
        values = torch.tensor(
            loss_and_median if self._root_gang.rank == spike_rank else (0.0, 0.0),
            dtype=torch.float64,
            device="cpu",
        )
        if spike_rank < 0:
            values.fill_(math.nan)
        self._root_gang.all_reduce(values, ReduceOperation.SUM)
        loss, median = values.tolist()
        raise LossSpikeDetected(Spike(step_nr, loss, median))

    def _raise_non_finite(
        self, loss_code: int, flagged_rank: int, unchecked_steps: tuple[int, int] | None
    ) -> None:
        size = self._root_gang.size
        flagged = flagged_rank < _NONE
        if loss_code < _NONE * size:
            step_nr, bad_rank = divmod(loss_code, size)
            problem = f"The loss was not finite at step {step_nr} on rank {bad_rank}"
            # A NaN loss makes NaN gradients, so the flag is up by this step at the latest; if
            # steps before it were unchecked, their gradients may have poisoned the weights.
            first = unchecked_steps[0] if unchecked_steps is not None else step_nr
            if flagged and first < step_nr:
                problem += (
                    f", and a gradient at a step from {first} to {step_nr} on rank {flagged_rank}"
                )
        elif flagged and unchecked_steps is not None:
            # The flag says whether, not when: naming the step would keep a flag per step.
            first, last = unchecked_steps
            span = f"step {last}" if first == last else f"a step from {first} to {last}"
            problem = f"The gradients were not finite at {span} on rank {flagged_rank}"
        else:
            return
        raise NonFiniteError(
            f"{problem} (nan_policy='error'): the training stopped, and no checkpoint was saved "
            "after that step. Lower the learning rate, clip gradients (max_gradient_norm), check "
            "the data of that step, or pass nan_policy='skip' to skip such steps."
        )


def _step_losses(
    losses: Sequence[tuple[int, Tensor]], read: Sequence[float], num_targets: Mapping[int, int]
) -> list[tuple[int, float]]:
    """Each step's loss on this rank: its micro-batches' summed losses over its targets."""
    sums: dict[int, float] = {}
    for (step_nr, _), value in zip(losses, read, strict=True):
        sums[step_nr] = sums.get(step_nr, 0.0) + value
    # A rank without targets at a step has no loss of it to judge.
    return [(s, total / num_targets[s]) for s, total in sums.items() if num_targets.get(s, 0) > 0]


def _read_window(
    losses: Sequence[tuple[int, Tensor]], flag: Tensor | None
) -> tuple[list[float], bool]:
    """The losses read on the host, and whether ``flag`` is set."""
    values = [loss.detach().float() for _, loss in losses]
    if flag is not None:
        values.append(flag.float())
    if not values:
        return [], False
    # One host read for the whole window.
    read = torch.stack(values).tolist()
    flagged = flag is not None and read.pop() != 0
    return read, flagged


def _where(loss_finite_here: bool, what: str) -> str:
    if what == "gradient norm":
        return "on every rank"
    return "on this rank" if not loss_finite_here else "on another rank"
