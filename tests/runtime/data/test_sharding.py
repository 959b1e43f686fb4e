"""ShardLayout's epoch length from the first and the last rank; OrderedShard's blocks."""

from __future__ import annotations

import itertools

import pytest
from torch import Tensor

from runtime.data.data_reader import SyncMode
from runtime.data.sharding import OrderedShard, ShardLayout


def test_the_epoch_length_is_the_bound_over_every_rank() -> None:
    for size, gang, batch, accumulate, drop, offset in itertools.product(
        (0, 1, 7, 64, 101), (1, 3, 8), (1, 4), (1, 3), (True, False), (0, 5)
    ):
        layout = ShardLayout(
            dataset_size=size,
            gang_size=gang,
            batch_size=batch,
            num_accumulate=accumulate,
            drop_remainder=drop,
        )
        steps = layout.steps_per_rank(offset)
        assert layout.epoch_length(offset, SyncMode.UNTIL_FIRST) == min(steps)
        assert layout.epoch_length(offset, SyncMode.UNTIL_LAST) == max(steps)


def test_an_ordered_shard_maps_its_positions_a_block_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def order(epoch: int, positions: Tensor) -> Tensor:
        calls.append(len(positions))
        return positions * 10 + epoch

    monkeypatch.setattr(OrderedShard, "BLOCK", 4)
    shard = OrderedShard(first=1, size=30, step=3, epoch=2, order=order)
    expected = [position * 10 + 2 for position in range(1, 30, 3)]
    assert len(shard) == 10
    assert shard[0:3].tolist() == expected[0:3]
    assert shard[3:9].tolist() == expected[3:9]  # across two blocks
    assert shard[9:12].tolist() == expected[9:10]
    assert calls == [4, 4, 2]  # each block once, read in order
