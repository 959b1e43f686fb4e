"""Data readers: batch contents and order, sharding, epoch ends, resume, prefetching, errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, final

import pytest
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from benchmarks.stand_in_gang import RankGang
from gangs import FakeGang, Gang
from runtime.data import (
    DataReader,
    DataReaderError,
    IterableDataReader,
    MapDataReader,
    SyncMode,
)
from tests.conftest import round_trip

Steps = list[list[list[int]]]


def as_list(examples: list[int]) -> list[int]:
    """A collate that keeps the example ids, so tests compare plain lists."""
    return list(examples)


def read_epoch(reader: DataReader[list[int]]) -> Steps:
    return [batches for batches in reader]


def permutation(size: int, seed: int) -> list[int]:
    order: list[int] = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    return order


def map_reader(size: int = 10, **kwargs: Any) -> MapDataReader[list[int]]:
    kwargs.setdefault("gang", FakeGang())
    kwargs.setdefault("collate", as_list)
    kwargs.setdefault("batch_size", 2)
    return MapDataReader(dataset=list(range(size)), **kwargs)


class RecordingDataset:
    """Records the thread that read each index; signals once ``watch_index`` was read."""

    def __init__(self, size: int, *, watch_index: int = -1, fail_index: int = -1) -> None:
        self.size = size
        self.threads: dict[int, str] = {}
        self.watched = threading.Event()
        self._watch_index = watch_index
        self._fail_index = fail_index

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        if index == self._fail_index:
            raise KeyError(f"example {index} is corrupt")
        self.threads[index] = threading.current_thread().name
        if index == self._watch_index:
            self.watched.set()
        return index


# ---------------------------------------------------------------------- MapDataReader, one rank


def test_unshuffled_steps_are_consecutive_batches_and_the_remainder_is_dropped() -> None:
    reader = map_reader(11, batch_size=3, shuffle=False)
    assert reader.num_accumulate == 1
    assert reader.num_steps == 3
    assert read_epoch(reader) == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]]]
    # The epoch stays over until reset.
    with pytest.raises(StopIteration):
        next(reader)


def test_default_collate_stacks_examples_into_tensors() -> None:
    reader = MapDataReader(dataset=list(range(4)), batch_size=2, gang=FakeGang(), shuffle=False)
    steps = [[batch.tolist() for batch in batches] for batches in reader]
    assert steps == [[[0, 1]], [[2, 3]]]


@final
class ExamplesOf(torch.utils.data.Dataset[Any]):
    """A map dataset with ``dataset``'s examples that is not a TensorDataset, so the reader must
    index it example by example."""

    def __init__(self, dataset: torch.utils.data.Dataset[Any], length: int) -> None:
        self._dataset = dataset
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        return self._dataset[index]


@pytest.mark.parametrize("gang", [FakeGang(), RankGang(rank=1, size=3)], ids=["dp1", "rank1of3"])
def test_a_tensor_dataset_gives_the_batches_default_collate_makes_of_its_examples(
    gang: Gang,
) -> None:
    generator = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(50, 3, generator=generator), torch.randint(0, 9, (50,), generator=generator)
    )

    def read(source: torch.utils.data.Dataset[Any]) -> list[list[list[Tensor]]]:
        reader: MapDataReader[Any] = MapDataReader(
            dataset=source,
            batch_size=4,
            gang=gang,
            num_accumulate=2,
            seed=3,  # type: ignore[arg-type]
        )
        return [batches for batches in reader]

    gathered, collated = read(dataset), read(ExamplesOf(dataset, 50))
    assert len(gathered) == len(collated) > 0
    for gathered_step, collated_step in zip(gathered, collated, strict=True):
        for gathered_batch, collated_batch in zip(gathered_step, collated_step, strict=True):
            assert isinstance(gathered_batch, list)
            assert len(gathered_batch) == len(collated_batch) == 2
            for mine, torchs in zip(gathered_batch, collated_batch, strict=True):
                assert mine.dtype == torchs.dtype
                assert torch.equal(mine, torchs)


def test_tensor_dataset_batches_across_several_gathers_and_a_resume_match_default_collate() -> None:
    # 301 examples in micro-batches of 2: gathers of 64, 64 and 23 micro-batches, a short last
    # micro-batch, and a resume that starts reading in the middle of a gather.
    dataset = torch.utils.data.TensorDataset(torch.arange(301.0), torch.arange(301))

    def reader_of(source: torch.utils.data.Dataset[Any]) -> MapDataReader[Any]:
        return MapDataReader(
            dataset=source,  # type: ignore[arg-type]
            batch_size=2,
            gang=FakeGang(),
            seed=5,
            drop_remainder=False,
            num_prefetch=0,
        )

    def as_lists(steps: list[list[list[Tensor]]]) -> list[list[list[list[float]]]]:
        return [[[field.tolist() for field in batch] for batch in step] for step in steps]

    expected = as_lists(list(reader_of(ExamplesOf(dataset, 301))))
    assert len(expected) == 151 and len(expected[-1][0][0]) == 1
    gathered = list(reader_of(dataset))
    assert as_lists(gathered) == expected

    # The micro-batches of one gather are views of one block of rows; the next gather is another.
    def block(step: list[list[Tensor]]) -> int:
        return step[0][0].untyped_storage().data_ptr()

    assert len({block(step) for step in gathered[:64]}) == 1
    assert block(gathered[64]) != block(gathered[0])

    reader = reader_of(dataset)
    for _ in range(70):
        next(reader)
    resumed = reader_of(dataset)
    resumed.load_state_dict(reader.state_dict())
    assert as_lists(list(resumed)) == expected[70:]


def test_a_dataset_with_getitems_is_asked_once_per_micro_batch() -> None:
    asked: list[list[int]] = []

    @final
    class Batched:
        def __len__(self) -> int:
            return 9

        def __getitem__(self, index: int) -> int:
            raise AssertionError("a dataset with __getitems__ is not indexed one by one")

        def __getitems__(self, indices: list[int]) -> list[int]:
            asked.append(indices)
            return [10 * index for index in indices]

    reader = MapDataReader(
        dataset=Batched(), batch_size=2, gang=FakeGang(), collate=as_list, shuffle=False
    )
    assert read_epoch(reader) == [[[0, 10]], [[20, 30]], [[40, 50]], [[60, 70]]]
    assert asked == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_num_accumulate_groups_micro_batches_into_steps() -> None:
    reader = map_reader(13, batch_size=2, num_accumulate=3, shuffle=False)
    # 6 full micro-batches make 2 steps; the short micro-batch [12] is dropped.
    assert read_epoch(reader) == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]]]


def test_drop_remainder_also_drops_a_partial_last_step() -> None:
    reader = map_reader(10, batch_size=2, num_accumulate=3, shuffle=False)
    assert read_epoch(reader) == [[[0, 1], [2, 3], [4, 5]]]


def test_without_drop_remainder_the_last_batch_and_step_are_partial() -> None:
    reader = map_reader(11, batch_size=2, num_accumulate=3, shuffle=False, drop_remainder=False)
    assert read_epoch(reader) == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10]]]


def test_shuffled_order_is_the_seeded_permutation_of_each_epoch() -> None:
    reader = map_reader(12, batch_size=3, seed=5, num_prefetch=1)
    for epoch in range(3):
        assert reader.epoch == epoch
        order = permutation(12, seed=5 + epoch)
        assert read_epoch(reader) == [[order[i : i + 3]] for i in range(0, 12, 3)]
        reader.reset()


def test_shuffle_is_deterministic_per_seed_and_differs_between_epochs_and_seeds() -> None:
    def epochs(seed: int) -> list[Steps]:
        reader = map_reader(32, batch_size=4, seed=seed)
        result = []
        for _ in range(2):
            result.append(read_epoch(reader))
            reader.reset()
        return result

    first, second = epochs(seed=7)
    assert epochs(seed=7) == [first, second]
    assert first != second
    assert epochs(seed=8)[0] != first
    # A shuffle reorders the examples; it neither loses nor repeats one.
    assert sorted(x for step in first for batch in step for x in batch) == list(range(32))


def test_reader_serves_a_for_loop_per_epoch() -> None:
    reader = map_reader(6, batch_size=2, shuffle=False)
    seen = []
    for _ in range(3):
        seen.append(sum(1 for _ in reader))
        reader.reset()
    assert seen == [3, 3, 3]


# ----------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_of_all_ranks_are_disjoint_and_cover_the_data(size: int, shuffle: bool) -> None:
    shards = []
    for rank in range(size):
        reader = map_reader(
            23,
            batch_size=2,
            gang=RankGang(rank=rank, size=size),
            shuffle=shuffle,
            drop_remainder=False,
            sync_mode=SyncMode.UNTIL_LAST,
        )
        shards.append([x for step in read_epoch(reader) for batch in step for x in batch])
    everything = [x for shard in shards for x in shard]
    assert sorted(everything) == list(range(23))


def test_shard_of_a_rank_strides_over_the_order() -> None:
    reader = map_reader(11, batch_size=2, gang=RankGang(rank=1, size=2), seed=3)
    order = permutation(11, seed=3)
    assert read_epoch(reader) == [[order[1::2][0:2]], [order[1::2][2:4]]]


def test_until_first_gives_every_rank_the_steps_of_the_shortest_shard() -> None:
    # 11 examples over 2 ranks in batches of 2: rank 0 has 3 micro-batches, rank 1 has 2.
    lengths = [
        len(read_epoch(map_reader(11, gang=RankGang(rank=rank, size=2)))) for rank in range(2)
    ]
    assert lengths == [2, 2]


def test_until_last_pads_the_shorter_ranks_with_empty_steps() -> None:
    steps = [
        read_epoch(
            map_reader(
                9,
                gang=RankGang(rank=rank, size=2),
                shuffle=False,
                drop_remainder=False,
                sync_mode=SyncMode.UNTIL_LAST,
            )
        )
        for rank in range(2)
    ]
    assert steps == [[[[0, 2]], [[4, 6]], [[8]]], [[[1, 3]], [[5, 7]], []]]


# ----------------------------------------------------------------------- resume


@pytest.mark.parametrize("num_prefetch", [0, 2])
def test_state_mid_epoch_resumes_the_identical_stream(num_prefetch: int) -> None:
    def reader() -> MapDataReader[list[int]]:
        return map_reader(40, batch_size=3, num_accumulate=2, seed=11, num_prefetch=num_prefetch)

    reference = reader()
    expected = [read_epoch(reference)]
    reference.reset()
    expected.append(read_epoch(reference))

    interrupted = reader()
    read_epoch(interrupted)
    interrupted.reset()
    head = [next(interrupted) for _ in range(2)]
    # The prefetch thread has prepared steps beyond these; the state must not count them.
    state = round_trip(interrupted.state_dict())
    assert state["epoch"] == 1
    assert state["step_nr"] == 2
    interrupted.close()

    resumed = reader()
    resumed.load_state_dict(state)
    assert head + read_epoch(resumed) == expected[1]


def test_state_at_an_epoch_end_round_trips() -> None:
    reader = map_reader(10, seed=2)
    read_epoch(reader)
    state = round_trip(reader.state_dict())

    resumed = map_reader(10, seed=2)
    resumed.load_state_dict(state)
    with pytest.raises(StopIteration):
        next(resumed)
    resumed.reset()
    reader.reset()
    assert resumed.epoch == 1
    assert read_epoch(resumed) == read_epoch(reader)


def examples_of(*steps_of_ranks: Steps) -> list[int]:
    """Every example of the given steps, of all ranks, sorted."""
    return sorted(e for steps in steps_of_ranks for batches in steps for b in batches for e in b)


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ({"size": 1, "batch_size": 4}, {"size": 2, "batch_size": 2}),
        ({"size": 2, "batch_size": 2}, {"size": 1, "batch_size": 4}),
        ({"size": 2, "batch_size": 2}, {"size": 4, "batch_size": 1}),
        ({"size": 2, "batch_size": 2}, {"size": 1, "batch_size": 2, "num_accumulate": 2}),
    ],
    ids=["dp1_to_dp2", "dp2_to_dp1", "dp2_to_dp4", "dp2_to_dp1_with_accumulation"],
)
def test_state_mid_epoch_reshards_to_another_layout(
    saved: dict[str, int], resumed: dict[str, int]
) -> None:
    def readers(size: int, **kwargs: int) -> list[MapDataReader[list[int]]]:
        return [
            map_reader(40, seed=7, gang=RankGang(rank=r, size=size), **kwargs) for r in range(size)
        ]

    before = readers(**saved)
    for reader in before:
        next(reader), next(reader)  # two steps of 4 examples in all: the first 8 of the epoch
    states = [round_trip(reader.state_dict()) for reader in before]

    after = readers(**resumed)
    for reader in after:
        reader.load_state_dict(states[0])
    rest = [read_epoch(reader) for reader in after]

    # Together the new ranks read the rest of the epoch's permutation, each example once, in
    # steps of the same 4 examples the saved layout would have taken.
    order = permutation(40, seed=7)
    assert examples_of(*rest) == sorted(order[8:])
    step_sets = [examples_of(*[[steps[k]] for steps in rest]) for k in range(len(rest[0]))]
    assert step_sets == [sorted(order[8 + 4 * k : 12 + 4 * k]) for k in range(8)]
    # The next epoch starts from the top, in the new layout.
    for reader in after:
        reader.reset()
    assert examples_of(*[read_epoch(reader) for reader in after]) == list(range(40))


def test_state_at_an_epoch_boundary_moves_to_another_layout() -> None:
    reader = map_reader(20, batch_size=2, seed=4)
    read_epoch(reader)
    reader.reset()
    state = round_trip(reader.state_dict())  # step 0 of epoch 1

    other = map_reader(20, batch_size=5, seed=4)
    other.load_state_dict(state)
    order = permutation(20, seed=4 + 1)
    assert read_epoch(other) == [[order[i : i + 5]] for i in range(0, 20, 5)]


def test_state_with_another_seed_is_rejected() -> None:
    state = map_reader(10, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"seed 1, shuffle True.*seed 2, shuffle True"):
        map_reader(10, seed=2).load_state_dict(state)


def test_state_of_another_reader_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="has no 'seed' entry"):
        map_reader().load_state_dict({"epoch": 0, "step_nr": 0, "num_steps": 5})


# --------------------------------------------------------------------- prefetching


def test_prefetch_thread_prepares_the_next_step_while_the_caller_holds_this_one() -> None:
    # Steps are [0, 1], [2, 3], ...; index 3 belongs to step 1.
    dataset = RecordingDataset(16, watch_index=3)
    reader = MapDataReader(
        dataset=dataset,
        batch_size=2,
        gang=FakeGang(),
        collate=as_list,
        shuffle=False,
        num_prefetch=1,
    )
    assert next(reader) == [[0, 1]]
    # Nobody calls next, yet step 1 gets read: in the background.
    assert dataset.watched.wait(timeout=30)
    assert set(dataset.threads.values()) == {"MapDataReader-prefetch-rank0"}
    # One step in the queue and one waiting to enter it: nothing beyond step 2 is read.
    assert max(dataset.threads) <= 5
    assert read_epoch(reader) == [[[i, i + 1]] for i in range(2, 16, 2)]
    reader.close()


def test_without_prefetch_the_caller_thread_reads() -> None:
    dataset = RecordingDataset(6)
    reader = MapDataReader(
        dataset=dataset, batch_size=2, gang=FakeGang(), collate=as_list, num_prefetch=0
    )
    read_epoch(reader)
    assert set(dataset.threads.values()) == {threading.current_thread().name}


def prefetch_threads(baseline: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """The live prefetch threads, other than those in ``baseline``."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("MapDataReader-prefetch") and t not in baseline
    ]


def test_prefetch_thread_stops_on_close_reset_and_load_and_restarts() -> None:
    # Readers of other tests that are not collected yet may still hold threads.
    baseline = frozenset(prefetch_threads())

    def prefetch_threads_() -> list[threading.Thread]:
        return prefetch_threads(baseline)

    reader = map_reader(40, batch_size=2, num_prefetch=2, shuffle=False)
    next(reader)
    assert len(prefetch_threads_()) == 1
    reader.close()
    assert prefetch_threads_() == []
    # Iterating again after close picks up where it was.
    assert next(reader) == [[2, 3]]
    state = reader.state_dict()

    reader.reset()
    assert prefetch_threads_() == []
    assert next(reader) == [[0, 1]]
    reader.load_state_dict(state)
    assert prefetch_threads_() == []
    assert next(reader) == [[4, 5]]
    assert len(prefetch_threads_()) == 1
    del reader
    assert prefetch_threads_() == []


@pytest.mark.parametrize("num_prefetch", [0, 2])
def test_dataset_errors_reach_the_caller_with_the_original_as_cause(num_prefetch: int) -> None:
    baseline = frozenset(prefetch_threads())
    dataset = RecordingDataset(10, fail_index=5)
    reader = MapDataReader(
        dataset=dataset,
        batch_size=2,
        gang=FakeGang(),
        collate=as_list,
        shuffle=False,
        num_prefetch=num_prefetch,
    )
    assert [next(reader), next(reader)] == [[[0, 1]], [[2, 3]]]
    with pytest.raises(DataReaderError, match="step 2 of data epoch 0 failed on rank 0") as info:
        next(reader)
    assert isinstance(info.value.__cause__, KeyError)
    assert "example 5 is corrupt" in str(info.value.__cause__)
    assert prefetch_threads(baseline) == []
    # The failed step was not consumed: a retry reads it again.
    with pytest.raises(DataReaderError):
        next(reader)
    assert reader.state_dict()["step_nr"] == 2


def test_collate_errors_reach_the_caller() -> None:
    def collate(examples: list[int]) -> list[int]:
        raise TypeError(f"cannot collate {examples}")

    reader = MapDataReader(dataset=list(range(4)), batch_size=2, gang=FakeGang(), collate=collate)
    with pytest.raises(DataReaderError, match="TypeError: cannot collate") as info:
        next(reader)
    assert isinstance(info.value.__cause__, TypeError)


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be greater than zero, but is 0 instead."),
        ({"num_accumulate": -1}, "num_accumulate must be greater than zero, but is -1 instead."),
        ({"num_prefetch": -1}, "num_prefetch must be zero or more, but is -1 instead."),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        map_reader(**kwargs)


def test_too_small_dataset_is_a_clear_error_when_read() -> None:
    # 7 examples over 2 ranks: rank 1 gets 3, but a step takes 2 x 2.
    reader = map_reader(7, batch_size=2, num_accumulate=2, gang=RankGang(rank=0, size=2))
    message = r"too small.*rank 1 of 2.*3 examples.*takes 4"
    with pytest.raises(ValueError, match=message) as info:
        next(reader)
    assert "drop_remainder=False" in str(info.value)
    with pytest.raises(ValueError, match=message):
        reader.check_has_steps()
    # Without the remainder dropped, every rank has a (partial) step.
    assert map_reader(7, batch_size=2, num_accumulate=2, drop_remainder=False).num_steps == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_a_reader_too_small_for_a_training_step_still_reads_for_evaluation(rank: int) -> None:
    # A valid reader built like a train reader: 5 examples over 2 ranks give no step of 4 with
    # drop_remainder, but evaluation keeps the remainder and reads every example.
    gang = RankGang(rank=rank, size=2)
    dataset = TensorDataset(torch.arange(5))
    reader = MapDataReader(dataset=dataset, batch_size=4, gang=gang, shuffle=False)
    evaluation = reader.for_evaluation()
    evaluation.check_has_steps()
    assert [[batch[0].tolist() for batch in batches] for batches in evaluation] == [
        [[0, 2, 4]] if rank == 0 else [[1, 3]]
    ]
    with pytest.raises(ValueError, match=r"too small.*5 examples give rank 0 of 2.*3 examples"):
        next(reader)


def test_empty_dataset_is_a_clear_error_in_until_last_too() -> None:
    reader = map_reader(0, sync_mode=SyncMode.UNTIL_LAST)
    with pytest.raises(
        ValueError, match=r"too small.*every rank has no step in sync_mode UNTIL_LAST"
    ):
        next(reader)
    with pytest.raises(ValueError, match="too small"):
        next(map_reader(0).for_evaluation())


# -------------------------------------------------------------- IterableDataReader, one rank


def iterable_reader(
    counts: Sequence[int], calls: list[int] | None = None, **kwargs: Any
) -> IterableDataReader[list[int]]:
    """Epoch ``e`` yields ``counts[e]`` examples numbered ``100 * e + i``; ``calls`` logs epochs."""

    def make_iterator(epoch: int) -> Iterator[int]:
        if calls is not None:
            calls.append(epoch)
        return iter(range(100 * epoch, 100 * epoch + counts[epoch]))

    kwargs.setdefault("collate", as_list)
    return IterableDataReader(make_iterator=make_iterator, gang=FakeGang(), **kwargs)


def test_iterable_reader_groups_and_drops_the_remainder() -> None:
    calls: list[int] = []
    reader = iterable_reader([11, 4], calls, batch_size=2, num_accumulate=2)
    assert read_epoch(reader) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(StopIteration):
        next(reader)
    reader.reset()
    assert read_epoch(reader) == [[[100, 101], [102, 103]]]
    assert calls == [0, 1]


def test_iterable_reader_keeps_a_partial_last_step_without_drop_remainder() -> None:
    reader = iterable_reader([7], batch_size=2, num_accumulate=2, drop_remainder=False)
    assert read_epoch(reader) == [[[0, 1], [2, 3]], [[4, 5], [6]]]


def test_iterable_reader_state_resumes_the_identical_stream() -> None:
    reader = iterable_reader([9, 9], batch_size=2)
    expected = read_epoch(reader)
    reader.reset()

    interrupted = iterable_reader([9, 9], batch_size=2)
    head = [next(interrupted), next(interrupted)]
    resumed = iterable_reader([9, 9], batch_size=2)
    resumed.load_state_dict(round_trip(interrupted.state_dict()))
    assert head + read_epoch(resumed) == expected

    # At the epoch end the state says so, and reset moves on to the next epoch.
    ended = iterable_reader([9, 9], batch_size=2)
    ended.load_state_dict(round_trip(resumed.state_dict()))
    with pytest.raises(StopIteration):
        next(ended)
    ended.reset()
    assert next(ended) == [[100, 101]]


def test_iterable_reader_state_cannot_move_to_another_gang_size_mid_epoch() -> None:
    reader = iterable_reader([9], batch_size=2)
    next(reader)
    state = reader.state_dict()
    other = IterableDataReader(
        make_iterator=lambda epoch: range(9), batch_size=2, gang=RankGang(rank=0, size=2)
    )
    with pytest.raises(ValueError, match=r"cannot be resharded.*gang\.size 1.*gang\.size 2"):
        other.load_state_dict(state)


def test_iterable_reader_errors_reach_the_caller() -> None:
    def make_iterator(epoch: int) -> Iterator[int]:
        yield 1
        raise OSError("the shard file is gone")

    reader = IterableDataReader(make_iterator=make_iterator, batch_size=1, gang=FakeGang())
    assert [batch.tolist() for batch in next(reader)] == [[1]]
    with pytest.raises(DataReaderError, match="step 1 of data epoch 0 failed on rank 0") as info:
        next(reader)
    assert isinstance(info.value.__cause__, OSError)


def test_iterable_reader_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="batch_size must be greater than zero, but is 0"):
        IterableDataReader(make_iterator=lambda epoch: [], batch_size=0, gang=FakeGang())


# ------------------------------------------------------------------ torchrun, 2 processes

WORKER = "tests/runtime/data/data_worker.py"


@pytest.fixture(scope="module")
def reports(two_rank_checks: Path) -> list[dict[str, Any]]:
    """What each rank read (WORKER's check, run in the shared two-rank launch). A reader that
    does not agree on the epoch end hangs; the launch's timeout turns that into a failure."""
    out = two_rank_checks / "readers"
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.distributed
def test_map_reader_until_first_ends_uneven_shards_together(reports: list[dict[str, Any]]) -> None:
    for epoch in range(2):
        order = permutation(11, seed=1 + epoch)
        for rank, report in enumerate(reports):
            shard = order[rank::2]
            assert report["map_until_first"][epoch] == [[shard[0:2]], [shard[2:4]]]


@pytest.mark.distributed
def test_map_reader_until_last_gives_the_short_rank_empty_steps(
    reports: list[dict[str, Any]],
) -> None:
    assert reports[0]["map_until_last"] == [[[[0, 2]], [[4, 6]], [[8]]]]
    assert reports[1]["map_until_last"] == [[[[1, 3]], [[5, 7]], []]]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "drop_remainder", "rank0", "rank1"),
    [
        # Rank 0 has 7 examples an epoch (ids 0..6), rank 1 has 3 (ids 100..102).
        ("UNTIL_FIRST", True, [[[0, 1]]], [[[100, 101]]]),
        ("UNTIL_FIRST", False, [[[0, 1]], [[2, 3]]], [[[100, 101]], [[102]]]),
        ("UNTIL_LAST", True, [[[0, 1]], [[2, 3]], [[4, 5]]], [[[100, 101]], [], []]),
        (
            "UNTIL_LAST",
            False,
            [[[0, 1]], [[2, 3]], [[4, 5]], [[6]]],
            [[[100, 101]], [[102]], [], []],
        ),
    ],
)
def test_iterable_reader_agrees_on_the_epoch_end(
    reports: list[dict[str, Any]],
    mode: str,
    drop_remainder: bool,
    rank0: Steps,
    rank1: Steps,
) -> None:
    epochs = [report[f"iterable_{mode}_{drop_remainder}"] for report in reports]

    def shifted(steps: Steps) -> Steps:
        return [[[x + 1000 for x in batch] for batch in step] for step in steps]

    assert epochs[0] == [rank0, shifted(rank0)]
    assert epochs[1] == [rank1, shifted(rank1)]


@pytest.mark.distributed
def test_ranks_set_up_differently_fail_together(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert "disagree on the data: dataset size (10 to 11)" in report["map_mismatch_error"]


@pytest.mark.distributed
def test_a_read_error_on_one_rank_stops_every_rank(reports: list[dict[str, Any]]) -> None:
    assert [report["iterable_failure_steps"] for report in reports] == [1, 1]
    assert "Another rank of the data-parallel gang failed" in reports[0]["iterable_failure_error"]
    assert "failed on rank 1: OSError" in reports[1]["iterable_failure_error"]


def test_for_evaluation_reads_every_example_once_with_the_remainder() -> None:
    gang = FakeGang()
    examples = torch.arange(23)
    reader = MapDataReader(
        dataset=TensorDataset(examples), batch_size=4, gang=gang, num_accumulate=2
    )
    evaluation = reader.for_evaluation()
    seen = torch.cat([batch[0] for batches in evaluation for batch in batches])
    assert sorted(seen.tolist()) == list(range(23))
    assert evaluation.num_accumulate == 1
    assert evaluation.for_evaluation() is evaluation

    iterable = IterableDataReader(
        make_iterator=lambda epoch: iter(range(7)), batch_size=3, gang=gang
    )
    read = [int(x) for batches in iterable.for_evaluation() for batch in batches for x in batch]
    assert read == list(range(7))


def test_a_text_reader_is_refused_as_a_valid_reader(tmp_path: Path) -> None:
    from runtime.data.text import TextDataReader, load_tokenizer

    (tmp_path / "valid.txt").write_text("some text\n" * 50)
    reader = TextDataReader(
        sources=tmp_path / "valid.txt",
        tokenizer=load_tokenizer(None),
        seq_len=8,
        batch_size=2,
        gang=FakeGang(),
    )
    with pytest.raises(ValueError, match="read it with MapDataReader"):
        reader.for_evaluation()


def test_a_dataset_with_set_epoch_is_told_each_epoch_before_it_is_read() -> None:
    class EpochDataset:
        def __init__(self) -> None:
            self.epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            return 10 * self.epoch + index

    reader = MapDataReader(
        dataset=EpochDataset(), batch_size=2, gang=FakeGang(), collate=as_list, shuffle=False
    )
    assert [batch for [batch] in reader] == [[0, 1], [2, 3]]
    reader.reset()
    assert [batch for [batch] in reader] == [[10, 11], [12, 13]]
