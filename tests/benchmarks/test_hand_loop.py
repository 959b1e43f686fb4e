from __future__ import annotations

import itertools

from benchmarks.loops.hand_loop import slice_starts
from benchmarks.workloads import make_workload


def test_the_ranks_take_consecutive_batches_and_wrap_at_the_epoch_end() -> None:
    workload = make_workload("mlp")
    batch_size = workload.batch_size
    steps_per_epoch = workload.num_examples() // (2 * batch_size)
    rank0 = list(itertools.islice(slice_starts(workload, num_ranks=2, rank=0), steps_per_epoch + 1))
    rank1 = list(itertools.islice(slice_starts(workload, num_ranks=2, rank=1), steps_per_epoch))
    assert rank0[:2] == [0, 2 * batch_size]
    assert rank1[:2] == [batch_size, 3 * batch_size]
    # Every batch of the epoch is read once, by one rank, and none runs past the data.
    assert sorted(rank0[:-1] + rank1) == list(
        range(0, 2 * steps_per_epoch * batch_size, batch_size)
    )
    assert max(rank1) + batch_size <= workload.num_examples()
    assert rank0[-1] == 0
