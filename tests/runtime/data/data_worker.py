"""Data readers under ``torchrun``: each rank writes the steps it received as JSON.

Usage: ``torchrun --nproc-per-node 2 tests/runtime/data/data_worker.py OUTPUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

from gangs import Gang, setup_gangs
from runtime.data import DataReader, DataReaderError, IterableDataReader, MapDataReader, SyncMode


def read_epochs(reader: DataReader[Tensor], num_epochs: int) -> list[list[list[list[int]]]]:
    """Every epoch's steps, each step a list of micro-batches as lists of example ids."""
    epochs = []
    for _ in range(num_epochs):
        epochs.append([[batch.tolist() for batch in batches] for batches in reader])
        reader.reset()
    return epochs


def uneven_examples(gang: Gang, *, fail_at: int | None = None) -> Any:
    """Rank 0 has 7 examples per epoch, rank 1 has 3; ``fail_at`` breaks rank 1 there."""

    def make_iterator(epoch: int) -> Iterator[int]:
        count = 7 if gang.rank == 0 else 3
        for i in range(count):
            if fail_at is not None and gang.rank == 1 and i == fail_at:
                raise OSError(f"shard file of example {i} is unreadable")
            yield 1000 * epoch + 100 * gang.rank + i

    return make_iterator


def check(dp: Gang) -> dict[str, Any]:
    """What this rank of the DP gang ``dp`` read with each reader."""
    report: dict[str, Any] = {"rank": dp.rank, "size": dp.size}

    # 11 examples over 2 ranks in batches of 2: rank 0 has 3 micro-batches, rank 1 has 2.
    report["map_until_first"] = read_epochs(
        MapDataReader(dataset=list(range(11)), batch_size=2, gang=dp, seed=1), 2
    )
    # 9 examples, remainder kept: rank 0 has [0, 2], [4, 6], [8]; rank 1 has [1, 3], [5, 7].
    report["map_until_last"] = read_epochs(
        MapDataReader(
            dataset=list(range(9)),
            batch_size=2,
            gang=dp,
            shuffle=False,
            drop_remainder=False,
            sync_mode=SyncMode.UNTIL_LAST,
        ),
        1,
    )
    for mode in SyncMode:
        for drop_remainder in (True, False):
            reader = IterableDataReader(
                make_iterator=uneven_examples(dp),
                batch_size=2,
                gang=dp,
                drop_remainder=drop_remainder,
                sync_mode=mode,
            )
            report[f"iterable_{mode.name}_{drop_remainder}"] = read_epochs(reader, 2)

    # A rank-dependent dataset size must fail on every rank, not hang or read mismatched shards.
    try:
        next(MapDataReader(dataset=list(range(10 + dp.rank)), batch_size=2, gang=dp))
    except DataReaderError as ex:
        report["map_mismatch_error"] = str(ex)

    failing = IterableDataReader(
        make_iterator=uneven_examples(dp, fail_at=2), batch_size=2, gang=dp
    )
    report["iterable_failure_steps"] = 0
    try:
        for _ in failing:
            report["iterable_failure_steps"] += 1
    except DataReaderError as ex:
        report["iterable_failure_error"] = str(ex)
    return report


def main(output_dir: Path) -> None:
    dp = setup_gangs().dp
    (output_dir / f"rank_{dp.rank}.json").write_text(json.dumps(check(dp)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
