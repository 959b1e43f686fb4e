"""How the ranks of a gang agree: on failures, on votes, on values, and on rank 0's decisions.

Every rank of the gang must make the same calls in the same order; each helper costs one
collective (two for :func:`decide_on_rank_zero` with a failure).

The values travel in CPU tensors whatever the gang's device: on CUDA the gang's CPU backend
(gloo) carries them, so agreeing never waits for the GPU's queued work, nor reads a result
back from it (a data reader agrees at every step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from gangs.gang import Gang, ReduceOperation

T = TypeVar("T")


def agree(
    gang: Gang, *, failed: bool, vote: int = 0, vote_op: ReduceOperation = ReduceOperation.MAX
) -> tuple[bool, int]:
    """Whether any rank ``failed``, and the ranks' votes reduced with ``vote_op`` (MIN or MAX).

    One all-reduce carries both: a vote of MIN rides as its negative in a MAX reduction.
    """
    if vote_op not in (ReduceOperation.MIN, ReduceOperation.MAX):
        raise ValueError(f"vote_op must be MIN or MAX, but is {vote_op} instead.")
    sign = 1 if vote_op is ReduceOperation.MAX else -1
    flags = torch.tensor([int(failed), sign * vote], dtype=torch.int64, device="cpu")
    gang.all_reduce(flags, ReduceOperation.MAX)
    any_failed, reduced = flags.tolist()
    return bool(any_failed), sign * int(reduced)


def run_on_all_ranks(
    gang: Gang,
    action: Callable[[], T],
    *,
    what: str,
    error_type: Callable[[str], Exception] = RuntimeError,
) -> T:
    """Run ``action`` on every rank; if it raises on any rank, raise ``error_type`` on every rank.

    The failed rank's error names its cause (``Failed to <what> on rank R: ...``); the others say
    that another rank failed, so no rank waits in a later collective for a rank that is gone.
    """
    error: Exception | None = None
    result: Any = None
    try:
        result = action()
    except Exception as ex:
        error = ex
    any_failed, _ = agree(gang, failed=error is not None)
    if error is not None:
        raise error_type(f"Failed to {what} on rank {gang.rank}: {error}") from error
    if any_failed:
        raise error_type(f"Failed to {what} on another rank; see that rank's log.")
    return result  # type: ignore[no-any-return]


def decide_on_rank_zero(
    gang: Gang, decide: Callable[[], T], *, on_failure: Callable[[str], Exception]
) -> T:
    """Rank 0 calls ``decide``; every rank returns its result, or raises if it raised.

    The result travels pickled, so it must be a plain value. On rank 0 the original exception
    propagates; the other ranks raise ``on_failure("<type>: <message>")`` of it.
    """
    verdict: list[Any] = [None]
    error: Exception | None = None
    if gang.rank == 0:
        try:
            verdict[0] = ("ok", decide())
        except Exception as ex:
            error = ex
            verdict[0] = ("error", f"{type(ex).__name__}: {ex}")
    gang.broadcast_objects(verdict)
    if error is not None:
        raise error
    status, payload = verdict[0]
    if status != "ok":
        raise on_failure(payload)
    return payload  # type: ignore[no-any-return]


def find_disagreements(gang: Gang, values: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """The values that differ across the ranks, each with its minimum and maximum.

    One all-reduce of the values and their negatives gives each value's maximum and minimum.
    """
    local = list(values.values())
    tensor = torch.tensor(local + [-v for v in local], dtype=torch.int64, device="cpu")
    gang.all_reduce(tensor, ReduceOperation.MAX)
    reduced = tensor.tolist()
    highs, lows = reduced[: len(local)], [-v for v in reduced[len(local) :]]
    return {
        name: (low, high)
        for name, low, high in zip(values, lows, highs, strict=True)
        if low != high
    }
