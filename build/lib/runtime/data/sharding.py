"""How the examples of a map-style epoch split into steps across the ranks of a data-parallel gang.

Epoch ``e`` visits the examples in a permutation; after the first ``offset`` of them (nonzero
only when a position was resharded), rank ``r`` takes every ``gang_size``-th example from ``r``
on. Every rank can count every other rank's steps, so the ranks agree on the epoch's end without
communicating.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import final

import torch
from torch import Tensor

from runtime.data.data_reader import SyncMode, divide


@final
@dataclass(frozen=True)
class ShardLayout:
    dataset_size: int
    gang_size: int
    batch_size: int
    num_accumulate: int
    drop_remainder: bool

    def num_examples_of(self, rank: int, offset: int) -> int:
        return len(range(offset + rank, self.dataset_size, self.gang_size))

    def num_micro_batches(self, num_examples: int) -> int:
        return divide(num_examples, self.batch_size, self.drop_remainder)

    def steps_of(self, rank: int, offset: int) -> int:
        """The number of steps of ``rank`` in an epoch that starts ``offset`` examples in."""
        return divide(
            self.num_micro_batches(self.num_examples_of(rank, offset)),
            self.num_accumulate,
            self.drop_remainder,
        )

    def steps_per_rank(self, offset: int) -> list[int]:
        """Each rank's number of steps in an epoch that starts ``offset`` examples in."""
        return [self.steps_of(rank, offset) for rank in range(self.gang_size)]

    def epoch_length(self, offset: int, sync_mode: SyncMode) -> int:
        """The steps of an epoch: until the first rank runs out (UNTIL_FIRST) or the last.

        The ranks take the examples in turn, so no rank has more steps than one before it: the
        first and the last rank give the bounds, whatever the number of ranks.
        """
        rank = self.gang_size - 1 if sync_mode is SyncMode.UNTIL_FIRST else 0
        return self.steps_of(rank, offset)

    def examples_before(self, step_nr: int) -> int:
        """Examples of the permutation the whole gang took in its first ``step_nr`` full steps."""
        return step_nr * self.batch_size * self.num_accumulate * self.gang_size

    def as_state(self) -> dict[str, object]:
        return asdict(self)

    def too_small_message(self, steps_per_rank: list[int], sync_mode: SyncMode) -> str:
        rank = steps_per_rank.index(0)
        num_examples = self.num_examples_of(rank, 0)
        if self.drop_remainder:
            need = (
                f"a step takes {self.batch_size * self.num_accumulate} (batch_size "
                f"{self.batch_size} x num_accumulate {self.num_accumulate}) and "
                "drop_remainder is set"
            )
        else:
            need = "a step takes at least one"
        return (
            f"The dataset is too small: its {self.dataset_size} examples give rank {rank} of "
            f"{self.gang_size} data-parallel ranks {num_examples} examples, but {need}, so "
            f"{'that rank' if sync_mode is SyncMode.UNTIL_FIRST else 'every rank'} has no "
            f"step in sync_mode {sync_mode.name}. Use a larger dataset, a smaller "
            "batch_size or num_accumulate, fewer data-parallel processes, or "
            "drop_remainder=False."
        )


def resume_position(
    saved: ShardLayout, now: ShardLayout, *, offset: int, step_nr: int, num_steps: int
) -> tuple[int, int | None]:
    """Where a reader of ``now`` goes on from a position saved under ``saved``.

    Returns the new offset and step, or ``(0, None)`` when the saved epoch was consumed: an
    epoch boundary means the same in every layout.
    """
    if step_nr >= num_steps:
        return 0, None
    if saved == now:
        return offset, step_nr
    # The shards stride over the epoch's permutation and differ by one example at most, so
    # before the epoch's last step every rank has taken only full steps, and together they took
    # exactly a prefix of the permutation: the new layout goes on after it.
    return offset + saved.examples_before(step_nr), 0


@final
class OrderedShard:
    """A rank's examples of an epoch whose order is computed, not materialized: positions
    ``first, first + step, ...`` below ``size``, mapped by ``order`` a block at a time, so
    neither the start of an epoch nor the memory grows with the shard.

    Sliced like the tensor of its examples (``shard[a:b]``), as the reader reads it: in order.
    """

    BLOCK = 1 << 16

    def __init__(
        self,
        *,
        first: int,
        size: int,
        step: int,
        epoch: int,
        order: Callable[[int, Tensor], Tensor],
    ) -> None:
        self._positions = range(first, size, step)
        self._epoch = epoch
        self._order = order
        self._block_nr = -1
        self._block = torch.empty(0, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, items: slice) -> Tensor:
        start, stop, _ = items.indices(len(self))
        pieces = []
        while start < stop:
            block_nr, offset = divmod(start, self.BLOCK)
            taken = min(stop - start, self.BLOCK - offset)
            pieces.append(self._examples_of(block_nr)[offset : offset + taken])
            start += taken
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)

    def _examples_of(self, block_nr: int) -> Tensor:
        if block_nr != self._block_nr:
            positions = self._positions[block_nr * self.BLOCK : (block_nr + 1) * self.BLOCK]
            self._block = self._order(self._epoch, torch.tensor(positions, dtype=torch.int64))
            self._block_nr = block_nr
        return self._block
