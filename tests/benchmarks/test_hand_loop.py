from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from benchmarks.loops.hand_loop import hand_step, hand_step_counted, slice_starts
from benchmarks.workloads import make_workload


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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


def test_the_counted_step_is_the_plain_step_on_one_rank(one_rank_group: None) -> None:
    # On one rank the targets of all ranks are this rank's: normalizing the gradients by their
    # all-reduced count is dividing the loss by it.
    workload = make_workload("mlp")
    plain, counted = workload.make_model(), workload.make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=workload.lr)
    counted_opt = torch.optim.AdamW(counted.parameters(), lr=workload.lr)
    initial = [p.detach().clone() for p in plain.parameters()]
    for start in itertools.islice(slice_starts(workload, num_ranks=1, rank=0), 3):
        hand_step(workload, plain, plain_opt, start)
        hand_step_counted(workload, counted, counted_opt, start)
    for before, a, b in zip(initial, plain.parameters(), counted.parameters(), strict=True):
        assert not torch.equal(before, a)
        torch.testing.assert_close(a, b)
