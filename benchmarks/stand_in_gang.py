"""A gang that claims to be one rank of many, for measuring and testing what a data reader does
on that rank without the other processes: readers set up alike on every rank all-reduce identical
values, which reduce to themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from typing_extensions import override

from gangs import Gang, ReduceOperation


@final
class RankGang(Gang):
    """A gang that claims to be rank ``rank`` of ``size`` processes, for the pure index logic.

    The readers set up alike on every rank all-reduce identical values, which reduce to
    themselves; so ``all_reduce`` leaves the tensor as it is. Nothing else is needed.
    """

    def __init__(self, *, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def size(self) -> int:
        return self._size

    @property
    @override
    def device(self) -> torch.device:
        return torch.device("cpu")

    @override
    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        pass

    @override
    def close(self) -> None:
        pass

    @override
    def make_gang(self, ranks: Sequence[int]) -> Gang | None:
        raise AssertionError("The readers must not make gangs.")

    @override
    def as_process_group(self) -> ProcessGroup:
        raise AssertionError("The readers must not use a process group.")

    @override
    def barrier(self) -> None:
        raise AssertionError("The readers must not wait in a barrier.")

    @override
    def all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        raise AssertionError("The readers must only all-reduce.")

    @override
    def all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        raise AssertionError("The readers must only all-reduce.")

    @override
    def broadcast(self, tensor: Tensor, source_rank: int = 0) -> None:
        raise AssertionError("The readers must only all-reduce.")

    @override
    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        raise AssertionError("The readers must only all-reduce.")

    @override
    def all_gather_objects(self, obj: Any) -> list[Any]:
        raise AssertionError("The readers must only all-reduce.")
