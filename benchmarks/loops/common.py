"""Pieces several loops share: the frameworks' data loader and endless batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.workloads import Workload


def make_data_loader(workload: Workload, *, shard: bool) -> DataLoader[Any]:
    """What a user of the frameworks writes: shuffled, each rank its share (when ``shard``)."""
    dataset = workload.dataset()
    sampler: DistributedSampler[Any] | None = (
        DistributedSampler(dataset, seed=workload.seed) if shard else None
    )
    return DataLoader(
        dataset,
        batch_size=workload.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        drop_last=True,
        collate_fn=workload.collate,
    )


def endless(batches: Iterable[Any]) -> Iterator[Any]:
    while True:
        yield from batches
