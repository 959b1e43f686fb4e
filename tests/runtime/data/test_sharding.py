"""ShardLayout: the epoch's length from the first and the last rank equals that from all ranks."""

from __future__ import annotations

import itertools

from runtime.data.data_reader import SyncMode
from runtime.data.sharding import ShardLayout


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
