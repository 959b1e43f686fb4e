"""Data readers: sharded, resumable streams of micro-batches, one list of them per step.

A :class:`DataReader` is what the Trainer iterates: every ``next`` returns the ``num_accumulate``
micro-batches of one optimizer step, and ``StopIteration`` marks the end of a data epoch on every
rank of the data-parallel gang at the same step, so no rank waits in a collective for a rank that
ran out of data.
"""

from __future__ import annotations

import itertools
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar, final, overload

import torch
from torch.utils.data import default_collate
from typing_extensions import Self, override

from gangs import Gang, ReduceOperation
from runtime.arguments import check_not_negative, check_positive

BatchT = TypeVar("BatchT")


class DataReaderError(RuntimeError):
    """Raised when reading a step fails, or when the ranks disagree on the data."""


class SyncMode(Enum):
    """When a data epoch ends for the ranks of a data-parallel gang whose shards differ in size."""

    UNTIL_FIRST = "until_first"
    """The epoch ends for everyone when the first rank runs out: for training, where DDP needs
    every rank in every step."""

    UNTIL_LAST = "until_last"
    """The epoch goes on until the last rank runs out; ranks already out return ``[]`` for those
    steps: for validation, where every example must count."""


class DataReader(ABC, Generic[BatchT]):
    """An iterator over the steps of a data epoch; each step is a list of micro-batches.

    Use it as ``for batches in reader: ...`` followed by ``reader.reset()`` for the next epoch.
    """

    def __iter__(self) -> Self:
        return self

    @abstractmethod
    def __next__(self) -> list[BatchT]:
        """Return the next step's ``num_accumulate`` micro-batches.

        Fewer only in the last step of an epoch when the reader keeps a partial last step, and
        ``[]`` on a rank that ran out of data in :attr:`SyncMode.UNTIL_LAST`. Raises
        ``StopIteration`` at the end of the data epoch, and keeps raising it until :meth:`reset`.
        """

    @abstractmethod
    def reset(self) -> None:
        """Start the next data epoch (for instance, with a new shuffle)."""

    @abstractmethod
    def state_dict(self) -> dict[str, object]:
        """The exact position in the data, as plain values that load with ``weights_only=True``."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position so that the next step equals that of an uninterrupted reader."""

    @property
    @abstractmethod
    def num_accumulate(self) -> int:
        """The number of micro-batches in a step."""

    def close(self) -> None:
        """Release background resources; iterating again acquires them anew."""


class MapDataset(Protocol):
    """A map-style dataset: a length and examples by index, like ``torch.utils.data.Dataset``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


@final
class MapDataReader(DataReader[BatchT]):
    """Reads a map-style dataset in shuffled, sharded micro-batches, prepared in the background.

    Epoch ``e`` visits the examples in the order of a permutation drawn from ``seed + e`` (the same
    on every rank); rank ``r`` of the gang takes every ``gang.size``-th example from ``r`` on. Since
    every rank can compute how many steps every other rank has, the epoch's length is agreed on
    without communication; one collective per epoch only checks that the ranks are set up alike.

    ``drop_remainder`` drops a last micro-batch smaller than ``batch_size`` and a last step with
    fewer than ``num_accumulate`` micro-batches; without it both are kept.

    A background thread prepares (indexes and collates) up to ``num_prefetch`` steps ahead, so that
    preparing step N+1 overlaps step N; ``num_prefetch=0`` prepares each step in ``__next__``.
    The dataset and ``collate`` must not use collectives: they run on that thread.
    """

    # Without a collate function the batch type is default_collate's, which is untyped.
    @overload
    def __init__(
        self: MapDataReader[Any],
        *,
        dataset: MapDataset,
        batch_size: int,
        gang: Gang,
        num_accumulate: int = ...,
        shuffle: bool = ...,
        seed: int = ...,
        drop_remainder: bool = ...,
        sync_mode: SyncMode = ...,
        num_prefetch: int = ...,
    ) -> None: ...

    @overload
    def __init__(
        self,
        *,
        dataset: MapDataset,
        batch_size: int,
        gang: Gang,
        collate: Callable[[list[Any]], BatchT],
        num_accumulate: int = ...,
        shuffle: bool = ...,
        seed: int = ...,
        drop_remainder: bool = ...,
        sync_mode: SyncMode = ...,
        num_prefetch: int = ...,
    ) -> None: ...

    def __init__(
        self,
        *,
        dataset: MapDataset,
        batch_size: int,
        gang: Gang,
        collate: Callable[[list[Any]], BatchT] = default_collate,
        num_accumulate: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
        sync_mode: SyncMode = SyncMode.UNTIL_FIRST,
        num_prefetch: int = 2,
    ) -> None:
        check_positive("batch_size", batch_size)
        check_positive("num_accumulate", num_accumulate)
        check_not_negative("num_prefetch", num_prefetch)

        self._dataset = dataset
        self._dataset_size = len(dataset)
        self._batch_size = batch_size
        self._collate = collate
        self._gang = gang
        self._num_accumulate = num_accumulate
        self._shuffle = shuffle
        self._seed = seed
        self._drop_remainder = drop_remainder
        self._sync_mode = sync_mode
        self._num_prefetch = num_prefetch

        # Examples of this epoch's permutation that steps before this reader's first step took,
        # under another layout: nonzero only after load_state_dict resharded a position.
        self._offset = 0
        steps_per_rank = self._count_steps()
        if self._num_steps == 0:
            raise ValueError(self._too_small_message(steps_per_rank))

        self._epoch = 0
        self._step_nr = 0  # steps returned by __next__ in this epoch, not steps prepared
        self._verified = False
        self._step_maker: _StepMaker[BatchT] | None = None
        self._prefetcher: _Prefetcher[BatchT] | None = None

    @override
    def __next__(self) -> list[BatchT]:
        # Every rank computes the same _num_steps, so they all stop here at the same step.
        if self._step_nr >= self._num_steps:
            raise StopIteration
        if not self._verified:
            self._verify_ranks_agree()
            self._verified = True

        step_nr = self._step_nr
        batches = [] if step_nr >= self._num_local_steps else self._read(step_nr)
        self._step_nr += 1
        return batches

    @override
    def reset(self) -> None:
        self._stop_prefetching()
        self._epoch += 1
        self._step_nr = 0
        self._offset = 0
        self._count_steps()
        self._step_maker = None
        self._verified = False

    @override
    def state_dict(self) -> dict[str, object]:
        return {
            "epoch": self._epoch,
            "step_nr": self._step_nr,
            "num_steps": self._num_steps,
            "offset": self._offset,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "dataset_size": self._dataset_size,
            "gang_size": self._gang.size,
            "batch_size": self._batch_size,
            "num_accumulate": self._num_accumulate,
            "drop_remainder": self._drop_remainder,
        }

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch = _int_entry(state, "epoch")
        step_nr = _int_entry(state, "step_nr")
        saved_num_steps = _int_entry(state, "num_steps")

        saved_order = {
            "seed": _int_entry(state, "seed"),
            "shuffle": bool(_int_entry(state, "shuffle")),
            "dataset_size": _int_entry(state, "dataset_size"),
        }
        order = {"seed": self._seed, "shuffle": self._shuffle, "dataset_size": self._dataset_size}
        if saved_order != order:
            raise ValueError(
                f"The data reader state was saved with {_describe(saved_order)}, but this reader "
                f"has {_describe(order)}, so its examples come in another order. Build the reader "
                "with the same dataset, seed and shuffle as the run that saved the state."
            )

        saved_offset = _int_entry(state, "offset")
        saved_layout = {
            "gang.size": _int_entry(state, "gang_size"),
            "batch_size": _int_entry(state, "batch_size"),
            "num_accumulate": _int_entry(state, "num_accumulate"),
            "drop_remainder": bool(_int_entry(state, "drop_remainder")),
        }
        layout = {
            "gang.size": self._gang.size,
            "batch_size": self._batch_size,
            "num_accumulate": self._num_accumulate,
            "drop_remainder": self._drop_remainder,
        }
        if step_nr >= saved_num_steps:
            # An epoch boundary means the same in every layout: the whole epoch is consumed.
            offset, step_nr = 0, -1
        elif saved_layout == layout:
            offset = saved_offset
        else:
            # The shards stride over the epoch's permutation and differ by one example at most,
            # so before the epoch's last step every rank has taken only full steps, and together
            # they took exactly a prefix of the permutation: the new layout goes on after it.
            per_rank = step_nr * saved_layout["batch_size"] * saved_layout["num_accumulate"]
            offset, step_nr = saved_offset + per_rank * saved_layout["gang.size"], 0

        self._stop_prefetching()
        self._epoch = epoch
        self._offset = offset
        self._count_steps()
        self._step_nr = self._num_steps if step_nr < 0 else min(step_nr, self._num_steps)
        self._step_maker = None
        self._verified = False

    @property
    @override
    def num_accumulate(self) -> int:
        return self._num_accumulate

    @property
    def epoch(self) -> int:
        """The number of the current data epoch, from 0."""
        return self._epoch

    @property
    def num_steps(self) -> int:
        """The number of steps in a data epoch, the same on every rank."""
        return self._num_steps

    @override
    def close(self) -> None:
        self._stop_prefetching()

    def __del__(self) -> None:
        # The thread holds no reference to the reader, so a dropped reader still stops it.
        if getattr(self, "_prefetcher", None) is not None:
            self._stop_prefetching()

    def _count_steps(self) -> list[int]:
        """Set the epoch's step counts from the examples after the offset; return each rank's."""
        steps_per_rank = [self._num_steps_of(rank) for rank in range(self._gang.size)]
        self._num_local_steps = steps_per_rank[self._gang.rank]
        if self._sync_mode is SyncMode.UNTIL_FIRST:
            self._num_steps = min(steps_per_rank)
        else:
            self._num_steps = max(steps_per_rank)
        return steps_per_rank

    def _num_steps_of(self, rank: int) -> int:
        num_examples = len(range(self._offset + rank, self._dataset_size, self._gang.size))
        num_micro_batches = _divide(num_examples, self._batch_size, self._drop_remainder)
        return _divide(num_micro_batches, self._num_accumulate, self._drop_remainder)

    def _too_small_message(self, steps_per_rank: list[int]) -> str:
        rank = steps_per_rank.index(0)
        num_examples = len(range(rank, self._dataset_size, self._gang.size))
        if self._drop_remainder:
            need = (
                f"a step takes {self._batch_size * self._num_accumulate} (batch_size "
                f"{self._batch_size} x num_accumulate {self._num_accumulate}) and "
                "drop_remainder is set"
            )
        else:
            need = "a step takes at least one"
        return (
            f"The dataset is too small: its {self._dataset_size} examples give rank {rank} of "
            f"{self._gang.size} data-parallel ranks {num_examples} examples, but {need}, so "
            f"{'that rank' if self._sync_mode is SyncMode.UNTIL_FIRST else 'every rank'} has no "
            f"step in sync_mode {self._sync_mode.name}. Use a larger dataset, a smaller "
            "batch_size or num_accumulate, fewer data-parallel processes, or "
            "drop_remainder=False."
        )

    def _verify_ranks_agree(self) -> None:
        # A rank set up differently would compute another epoch length and hang the others later;
        # one all-reduce of the values and their negatives gives each value's maximum and minimum.
        values = {
            "dataset size": self._dataset_size,
            "batch_size": self._batch_size,
            "num_accumulate": self._num_accumulate,
            "drop_remainder": int(self._drop_remainder),
            "shuffle": int(self._shuffle),
            "seed": self._seed % (1 << 62),
            "sync_mode": list(SyncMode).index(self._sync_mode),
            "data epoch": self._epoch,
            "step": self._step_nr,
        }
        local = list(values.values())
        tensor = torch.tensor(local + [-v for v in local], device=self._gang.device)
        self._gang.all_reduce(tensor, ReduceOperation.MAX)
        reduced = tensor.tolist()
        highs, lows = reduced[: len(local)], [-v for v in reduced[len(local) :]]
        differ = [
            f"{name} ({low} to {high})"
            for name, low, high in zip(values, lows, highs, strict=True)
            if low != high
        ]
        if differ:
            raise DataReaderError(
                f"The {self._gang.size} ranks of the data-parallel gang disagree on the data: "
                f"{', '.join(differ)}. Build every rank's reader with the same dataset and "
                "settings, and load every rank's reader state from the same checkpoint."
            )

    def _read(self, step_nr: int) -> list[BatchT]:
        if self._step_maker is None:
            self._step_maker = self._make_step_maker()

        if self._num_prefetch == 0:
            try:
                return self._step_maker(step_nr)
            except Exception as ex:
                raise self._read_error(step_nr, ex) from ex

        if self._prefetcher is None:
            self._prefetcher = _Prefetcher(
                make_step=self._step_maker,
                steps=range(step_nr, self._num_local_steps),
                capacity=self._num_prefetch,
                name=f"MapDataReader-prefetch-rank{self._gang.rank}",
            )
        prepared = self._prefetcher.get()
        if prepared.error is not None:
            # The thread has stopped; the next call starts a new one at the same step.
            self._stop_prefetching()
            raise self._read_error(step_nr, prepared.error) from prepared.error
        if prepared.step_nr != step_nr:
            raise DataReaderError(
                f"The prefetch thread prepared step {prepared.step_nr}, but step {step_nr} is due. "
                "This is a bug in MapDataReader; please report it."
            )
        return prepared.batches

    def _make_step_maker(self) -> _StepMaker[BatchT]:
        if self._shuffle:
            generator = torch.Generator().manual_seed(self._seed + self._epoch)
            order = torch.randperm(self._dataset_size, generator=generator)
        else:
            order = torch.arange(self._dataset_size)
        shard: list[int] = order[self._offset + self._gang.rank :: self._gang.size].tolist()
        return _StepMaker(
            dataset=self._dataset,
            collate=self._collate,
            shard=shard,
            batch_size=self._batch_size,
            num_accumulate=self._num_accumulate,
            num_micro_batches=_divide(len(shard), self._batch_size, self._drop_remainder),
        )

    def _read_error(self, step_nr: int, error: BaseException) -> DataReaderError:
        return DataReaderError(
            f"Reading step {step_nr} of data epoch {self._epoch} failed on rank {self._gang.rank}: "
            f"{type(error).__name__}: {error}. The dataset or the collate function raised it; "
            "see the cause above."
        )

    def _stop_prefetching(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None


@final
class IterableDataReader(DataReader[BatchT]):
    """Reads examples from per-epoch iterators whose length is unknown in advance.

    ``make_iterator(epoch)`` returns this rank's examples of data epoch ``epoch`` (from 0): the
    caller shards. As no rank knows when the others run out, the ranks all-reduce a flag each step.
    ``drop_remainder`` drops a last micro-batch smaller than ``batch_size`` and a last step with
    fewer than ``num_accumulate`` micro-batches.

    An exception while reading on one rank makes every rank raise :class:`DataReaderError`, so
    none waits for the failed one.
    """

    @overload
    def __init__(
        self: IterableDataReader[Any],
        *,
        make_iterator: Callable[[int], Iterable[Any]],
        batch_size: int,
        gang: Gang,
        num_accumulate: int = ...,
        drop_remainder: bool = ...,
        sync_mode: SyncMode = ...,
    ) -> None: ...

    @overload
    def __init__(
        self,
        *,
        make_iterator: Callable[[int], Iterable[Any]],
        batch_size: int,
        gang: Gang,
        collate: Callable[[list[Any]], BatchT],
        num_accumulate: int = ...,
        drop_remainder: bool = ...,
        sync_mode: SyncMode = ...,
    ) -> None: ...

    def __init__(
        self,
        *,
        make_iterator: Callable[[int], Iterable[Any]],
        batch_size: int,
        gang: Gang,
        collate: Callable[[list[Any]], BatchT] = default_collate,
        num_accumulate: int = 1,
        drop_remainder: bool = True,
        sync_mode: SyncMode = SyncMode.UNTIL_FIRST,
    ) -> None:
        check_positive("batch_size", batch_size)
        check_positive("num_accumulate", num_accumulate)

        self._make_iterator = make_iterator
        self._batch_size = batch_size
        self._collate = collate
        self._gang = gang
        self._num_accumulate = num_accumulate
        self._drop_remainder = drop_remainder
        self._sync_mode = sync_mode

        self._epoch = 0
        self._step_nr = 0
        self._num_examples = 0  # read from this epoch's iterator, to skip them on resume
        self._epoch_done = False
        self._iterator: Iterator[Any] | None = None

    @override
    def __next__(self) -> list[BatchT]:
        if self._epoch_done:
            raise StopIteration

        error: Exception | None = None
        batches: list[BatchT] = []
        try:
            batches = self._read_local_step()
        except Exception as ex:
            error = ex

        # MIN lets every rank continue only if all have a step, MAX if any has one; the error
        # code is the extreme of the same reduction, so a failure on one rank reaches all.
        until_first = self._sync_mode is SyncMode.UNTIL_FIRST
        failed_code = -1 if until_first else 2
        flag = torch.tensor(
            [failed_code if error is not None else int(bool(batches))], device=self._gang.device
        )
        self._gang.all_reduce(flag, ReduceOperation.MIN if until_first else ReduceOperation.MAX)
        agreed = int(flag.item())

        if agreed == failed_code:
            if error is not None:
                raise DataReaderError(
                    f"Reading step {self._step_nr} of data epoch {self._epoch} failed on rank "
                    f"{self._gang.rank}: {type(error).__name__}: {error}. The iterator or the "
                    "collate function raised it; see the cause above."
                ) from error
            raise DataReaderError(
                f"Another rank of the data-parallel gang failed to read step {self._step_nr} of "
                f"data epoch {self._epoch}, so rank {self._gang.rank} stops too. The log of the "
                "failed rank has the cause."
            )
        if agreed == 0:
            self._epoch_done = True
            raise StopIteration

        self._step_nr += 1
        return batches

    @override
    def reset(self) -> None:
        self._epoch += 1
        self._step_nr = 0
        self._num_examples = 0
        self._epoch_done = False
        self._iterator = None

    @override
    def state_dict(self) -> dict[str, object]:
        return {
            "epoch": self._epoch,
            "step_nr": self._step_nr,
            "num_examples": self._num_examples,
            "epoch_done": self._epoch_done,
            "gang_size": self._gang.size,
        }

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch = _int_entry(state, "epoch")
        step_nr = _int_entry(state, "step_nr")
        num_examples = _int_entry(state, "num_examples")
        epoch_done = bool(_int_entry(state, "epoch_done"))
        gang_size = _int_entry(state, "gang_size")
        at_boundary = epoch_done or num_examples == 0
        # The caller shards by the gang, so a position within another gang's shard means nothing.
        if gang_size != self._gang.size and not at_boundary:
            raise ValueError(
                f"The data position (step {step_nr} of data epoch {epoch}) cannot be resharded: "
                f"it was saved with gang.size {gang_size}, but this reader has gang.size "
                f"{self._gang.size}. Resume with the same number of data-parallel processes, or "
                "start a fresh data epoch instead of loading this position."
            )

        self._epoch = epoch
        self._step_nr = step_nr
        self._num_examples = num_examples
        self._epoch_done = epoch_done
        self._iterator = None

    @property
    @override
    def num_accumulate(self) -> int:
        return self._num_accumulate

    @property
    def epoch(self) -> int:
        """The number of the current data epoch, from 0."""
        return self._epoch

    @override
    def close(self) -> None:
        self._iterator = None

    def _read_local_step(self) -> list[BatchT]:
        """This rank's next step, or ``[]`` if it has none (the remainder may be dropped)."""
        if self._iterator is None:
            self._iterator = iter(self._make_iterator(self._epoch))
            # Reading the examples again is the only way back to a position in an iterator.
            for _ in itertools.islice(self._iterator, self._num_examples):
                pass

        step_size = self._batch_size * self._num_accumulate
        examples = list(itertools.islice(self._iterator, step_size))
        self._num_examples += len(examples)
        if self._drop_remainder and len(examples) < step_size:
            return []
        return [
            self._collate(examples[start : start + self._batch_size])
            for start in range(0, len(examples), self._batch_size)
        ]


@final
class _StepMaker(Generic[BatchT]):
    """Turns the step numbers of one epoch into collated micro-batches; no collectives.

    It holds what a step needs but not the reader, so the reader can be collected while the
    prefetch thread runs.
    """

    def __init__(
        self,
        *,
        dataset: MapDataset,
        collate: Callable[[list[Any]], BatchT],
        shard: list[int],
        batch_size: int,
        num_accumulate: int,
        num_micro_batches: int,
    ) -> None:
        self._dataset = dataset
        self._collate = collate
        self._shard = shard
        self._batch_size = batch_size
        self._num_accumulate = num_accumulate
        self._num_micro_batches = num_micro_batches

    def __call__(self, step_nr: int) -> list[BatchT]:
        first = step_nr * self._num_accumulate
        last = min(first + self._num_accumulate, self._num_micro_batches)
        batches = []
        for micro_batch_nr in range(first, last):
            start = micro_batch_nr * self._batch_size
            indices = self._shard[start : start + self._batch_size]
            batches.append(self._collate([self._dataset[index] for index in indices]))
        return batches


@dataclass(frozen=True)
class _Prepared(Generic[BatchT]):
    step_nr: int
    batches: list[BatchT]
    error: Exception | None = None


@final
class _Prefetcher(Generic[BatchT]):
    """A daemon thread that prepares ``steps`` in order into a queue of ``capacity`` steps."""

    def __init__(
        self,
        *,
        make_step: Callable[[int], list[BatchT]],
        steps: range,
        capacity: int,
        name: str,
    ) -> None:
        self._queue: queue.Queue[_Prepared[BatchT]] = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_prefetch,
            args=(make_step, steps, self._queue, self._stop),
            name=name,
            daemon=True,
        )
        self._thread.start()

    def get(self) -> _Prepared[BatchT]:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                # The thread puts before it exits, so a dead thread and an empty queue is final.
                if not self._thread.is_alive() and self._queue.empty():
                    raise DataReaderError(
                        f"The prefetch thread {self._thread.name} exited without preparing the "
                        "next step; an error that is not an Exception stopped it. Check the "
                        "log for its traceback, or use num_prefetch=0 to read in this thread."
                    ) from None

    def close(self) -> None:
        self._stop.set()
        # Emptying the queue wakes a thread blocked in put; it then sees the stop event.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()


def _prefetch(
    make_step: Callable[[int], list[BatchT]],
    steps: range,
    out: queue.Queue[_Prepared[BatchT]],
    stop: threading.Event,
) -> None:
    for step_nr in steps:
        if stop.is_set():
            return
        try:
            prepared = _Prepared(step_nr, make_step(step_nr))
        except Exception as ex:
            prepared = _Prepared(step_nr, [], error=ex)
        out.put(prepared)
        if prepared.error is not None:
            return


def _divide(count: int, size: int, drop_remainder: bool) -> int:
    return count // size if drop_remainder else -(-count // size)


def _int_entry(state: Mapping[str, Any], key: str) -> int:
    try:
        value = state[key]
    except KeyError:
        raise ValueError(
            f"The data reader state has no '{key}' entry; it has {sorted(state)}. Load a state "
            "saved by the same kind of data reader."
        ) from None
    if isinstance(value, torch.Tensor):
        value = value.item()
    if not isinstance(value, int):
        raise ValueError(
            f"The '{key}' entry of the data reader state must be an integer, but is "
            f"{value!r} instead. Load a state saved by the same kind of data reader."
        )
    return value


def _describe(values: Mapping[str, object]) -> str:
    return ", ".join(f"{name} {value}" for name, value in values.items())
