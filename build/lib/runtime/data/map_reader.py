"""Reading a map-style dataset in shuffled, sharded micro-batches, prepared in the background."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar, final, overload

import torch
from torch import Tensor
from torch.utils.data import TensorDataset, default_collate
from typing_extensions import override

from gangs import Gang, find_disagreements
from runtime.data.data_reader import DataReader, DataReaderError, SyncMode, int_entry
from runtime.data.device import pin_memory
from runtime.data.prefetch import Prefetcher
from runtime.data.sharding import OrderedShard, ShardLayout, resume_position
from trainkit_utils.arguments import check_not_negative, check_positive

BatchT = TypeVar("BatchT")


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

    A micro-batch is fetched the cheapest way the dataset allows: from a ``TensorDataset`` with the
    default collate function, one ``index_select`` per tensor gathers the rows of up to 64
    micro-batches (16 MiB), and each micro-batch is a view of its rows (the same values
    ``default_collate`` stacks from single examples, without a Python call per example); a dataset
    with ``__getitems__`` (torch's batched protocol, which ``DataLoader`` uses too) gets one call
    per micro-batch; any other dataset is indexed example by example.

    ``order(e, positions)`` (with ``shuffle=False``) gives the examples instead, for this rank's
    positions a block at a time as they are read: neither an epoch's start nor the memory grows
    with the dataset (:class:`~runtime.data.permutation.ShuffledOrder`).

    A dataset with a ``set_epoch(epoch)`` method (as ``DistributedSampler`` has) is told each
    data epoch before any of its examples are read in it.

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
        order: Callable[[int, Tensor], Tensor] | None = ...,
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
        order: Callable[[int, Tensor], Tensor] | None = ...,
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
        order: Callable[[int, Tensor], Tensor] | None = None,
    ) -> None:
        check_positive("batch_size", batch_size)
        check_positive("num_accumulate", num_accumulate)
        check_not_negative("num_prefetch", num_prefetch)

        self._dataset = dataset
        self._collate = collate
        self._gang = gang
        self._layout = ShardLayout(
            dataset_size=len(dataset),
            gang_size=gang.size,
            batch_size=batch_size,
            num_accumulate=num_accumulate,
            drop_remainder=drop_remainder,
        )
        if order is not None and shuffle:
            raise ValueError("order and shuffle both decide the order: give shuffle=False.")
        self._shuffle = shuffle
        self._order = order
        self._seed = seed
        self._sync_mode = sync_mode
        self._num_prefetch = num_prefetch

        # Examples of this epoch's permutation that steps before this reader's first step took,
        # under another layout: nonzero only after load_state_dict resharded a position.
        self._offset = 0
        self._count_steps()

        self._epoch = 0
        self._step_nr = 0  # steps returned by __next__ in this epoch, not steps prepared
        self._verified = False
        self._step_maker: _StepMaker[BatchT] | None = None
        self._prefetcher: Prefetcher[BatchT] | None = None

    @override
    def __next__(self) -> list[BatchT]:
        # Every rank computes the same _num_steps, so they all stop here at the same step.
        if self._step_nr >= self._num_steps:
            if self._offset == 0:
                self.check_has_steps()
            raise StopIteration
        if not self._verified:
            self._verify_ranks_agree()
            self._verified = True

        step_nr = self._step_nr
        batches = [] if step_nr >= self._num_local_steps else self._read(step_nr)
        self._step_nr += 1
        return batches

    def check_has_steps(self) -> None:
        """Raise a ValueError that says why and what to change if the dataset is too small for
        one step of every rank that needs one (all of them in ``UNTIL_FIRST``, one in
        ``UNTIL_LAST``).

        Reading such a reader raises it at the first step. The constructor does not: a reader
        built like a training reader may still serve as a valid reader, and
        :meth:`for_evaluation` reads the same dataset in steps that may well fit it.
        """
        if self._layout.epoch_length(0, self._sync_mode) == 0:
            steps_per_rank = self._layout.steps_per_rank(0)
            raise ValueError(self._layout.too_small_message(steps_per_rank, self._sync_mode))

    @override
    def for_evaluation(self) -> MapDataReader[BatchT]:
        layout = self._layout
        if (
            not layout.drop_remainder
            and layout.num_accumulate == 1
            and self._sync_mode is SyncMode.UNTIL_LAST
        ):
            return self
        return MapDataReader(
            dataset=self._dataset,
            batch_size=layout.batch_size,
            gang=self._gang,
            collate=self._collate,
            shuffle=self._shuffle,
            seed=self._seed,
            drop_remainder=False,
            sync_mode=SyncMode.UNTIL_LAST,
            num_prefetch=self._num_prefetch,
            order=self._order,
        )

    @override
    def reset(self) -> None:
        self._go_to(epoch=self._epoch + 1, offset=0, step_nr=0)

    @override
    def state_dict(self) -> dict[str, object]:
        return {
            "epoch": self._epoch,
            "step_nr": self._step_nr,
            "num_steps": self._num_steps,
            "offset": self._offset,
            "seed": self._seed,
            "shuffle": self._shuffle,
            **self._layout.as_state(),
        }

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved_order = {
            "seed": int_entry(state, "seed"),
            "shuffle": bool(int_entry(state, "shuffle")),
            "dataset_size": int_entry(state, "dataset_size"),
        }
        order = {
            "seed": self._seed,
            "shuffle": self._shuffle,
            "dataset_size": self._layout.dataset_size,
        }
        if saved_order != order:
            raise ValueError(
                f"The data reader state was saved with {_describe(saved_order)}, but this reader "
                f"has {_describe(order)}, so its examples come in another order. Build the reader "
                "with the same dataset, seed and shuffle as the run that saved the state."
            )
        saved_layout = ShardLayout(
            dataset_size=saved_order["dataset_size"],
            gang_size=int_entry(state, "gang_size"),
            batch_size=int_entry(state, "batch_size"),
            num_accumulate=int_entry(state, "num_accumulate"),
            drop_remainder=bool(int_entry(state, "drop_remainder")),
        )
        offset, step_nr = resume_position(
            saved_layout,
            self._layout,
            offset=int_entry(state, "offset"),
            step_nr=int_entry(state, "step_nr"),
            num_steps=int_entry(state, "num_steps"),
        )
        self._go_to(epoch=int_entry(state, "epoch"), offset=offset, step_nr=step_nr)

    @property
    @override
    def num_accumulate(self) -> int:
        return self._layout.num_accumulate

    @property
    def epoch(self) -> int:
        """The number of the current data epoch, from 0."""
        return self._epoch

    @property
    def num_steps(self) -> int:
        """The number of steps in a data epoch, the same on every rank (0 for a dataset too
        small for a step, which reading refuses)."""
        return self._num_steps

    @override
    def close(self) -> None:
        self._stop_prefetching()

    def __del__(self) -> None:
        # The thread holds no reference to the reader, so a dropped reader still stops it.
        if getattr(self, "_prefetcher", None) is not None:
            self._stop_prefetching()

    def _go_to(self, *, epoch: int, offset: int, step_nr: int | None) -> None:
        """Move to ``step_nr`` of ``epoch`` (its end if None), ``offset`` examples into it."""
        self._stop_prefetching()
        self._epoch = epoch
        self._offset = offset
        self._count_steps()
        self._step_nr = self._num_steps if step_nr is None else min(step_nr, self._num_steps)
        self._step_maker = None
        self._verified = False

    def _count_steps(self) -> None:
        """Set the epoch's step counts from the examples after the offset."""
        self._num_local_steps = self._layout.steps_of(self._gang.rank, self._offset)
        self._num_steps = self._layout.epoch_length(self._offset, self._sync_mode)

    def _verify_ranks_agree(self) -> None:
        # A rank set up differently would compute another epoch length and hang the others later.
        layout = self._layout
        differ = find_disagreements(
            self._gang,
            {
                "dataset size": layout.dataset_size,
                "batch_size": layout.batch_size,
                "num_accumulate": layout.num_accumulate,
                "drop_remainder": int(layout.drop_remainder),
                "shuffle": int(self._shuffle),
                "seed": self._seed % (1 << 62),
                "sync_mode": list(SyncMode).index(self._sync_mode),
                "data epoch": self._epoch,
                "step": self._step_nr,
            },
        )
        if differ:
            described = ", ".join(
                f"{name} ({low} to {high})" for name, (low, high) in differ.items()
            )
            raise DataReaderError(
                f"The {self._gang.size} ranks of the data-parallel gang disagree on the data: "
                f"{described}. Build every rank's reader with the same dataset and settings, and "
                "load every rank's reader state from the same checkpoint."
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
            self._prefetcher = Prefetcher(
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
        # No prefetch thread is running here: the epoch's first step is being made.
        set_epoch = getattr(self._dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)
        size = self._layout.dataset_size
        first, step = self._offset + self._gang.rank, self._gang.size
        shard: Tensor | OrderedShard
        if self._shuffle:
            generator = torch.Generator().manual_seed(self._seed + self._epoch)
            shard = torch.randperm(size, generator=generator)[first::step]
        elif self._order is not None:
            shard = OrderedShard(
                first=first, size=size, step=step, epoch=self._epoch, order=self._order
            )
        else:
            shard = torch.arange(first, size, step)
        return _StepMaker(
            dataset=self._dataset,
            collate=self._collate,
            shard=shard,
            batch_size=self._layout.batch_size,
            num_accumulate=self._layout.num_accumulate,
            num_micro_batches=self._layout.num_micro_batches(len(shard)),
            pin=self._gang.device.type == "cuda",
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
        shard: Tensor | OrderedShard,
        batch_size: int,
        num_accumulate: int,
        num_micro_batches: int,
        pin: bool,
    ) -> None:
        self._dataset = dataset
        self._pin = pin
        self._collate = collate
        self._batch_size = batch_size
        self._num_accumulate = num_accumulate
        self._num_micro_batches = num_micro_batches
        self._fetch: Callable[[int, int], BatchT]
        self._tensors: tuple[Tensor, ...] = ()
        self._shard = shard
        # The rows of the micro-batches being read, gathered ahead: their first position in the
        # shard, and one tensor per dataset tensor.
        self._gathered_start = 0
        self._gathered: list[Tensor] = []
        self._gather_size = batch_size
        if isinstance(dataset, TensorDataset) and collate is default_collate:
            self._tensors = tuple(dataset.tensors)
            self._gather_size = batch_size * _micro_batches_per_gather(self._tensors, batch_size)
            self._fetch = self._gather
        else:
            getitems = getattr(dataset, "__getitems__", None)
            self._fetch = self._fetch_batch if callable(getitems) else self._fetch_examples

    def __call__(self, step_nr: int) -> list[BatchT]:
        first = step_nr * self._num_accumulate
        last = min(first + self._num_accumulate, self._num_micro_batches)
        batches = []
        for micro_batch_nr in range(first, last):
            start = micro_batch_nr * self._batch_size
            batches.append(self._fetch(start, start + self._batch_size))
        if self._pin:
            # Here, on the prefetch thread, rather than on the training thread when it copies
            # the batch to the GPU: pinning is a host copy.
            return [pin_memory(batch) for batch in batches]
        return batches

    def _gather(self, start: int, stop: int) -> BatchT:
        # What default_collate makes of TensorDataset examples: a list with each field stacked.
        # One index_select gathers the rows of several micro-batches, and each is a view of its
        # own rows: per micro-batch, reading then costs what slicing a tensor costs.
        if not self._gathered or not 0 <= start - self._gathered_start < self._gather_size:
            self._gathered_start = start - start % self._gather_size
            indices = self._shard[self._gathered_start : self._gathered_start + self._gather_size]
            self._gathered = [tensor.index_select(0, indices) for tensor in self._tensors]
        first, last = start - self._gathered_start, stop - self._gathered_start
        return [rows[first:last] for rows in self._gathered]  # type: ignore[return-value]

    def _fetch_batch(self, start: int, stop: int) -> BatchT:
        examples = self._dataset.__getitems__(self._indices(start, stop))  # type: ignore[attr-defined]
        return self._collate(examples)

    def _fetch_examples(self, start: int, stop: int) -> BatchT:
        dataset = self._dataset
        return self._collate([dataset[index] for index in self._indices(start, stop)])

    def _indices(self, start: int, stop: int) -> list[int]:
        # Python ints, a micro-batch at a time: a dataset need not accept a 0-dim tensor as its
        # index, and a shard of millions held as Python ints would cost 36 bytes each.
        indices: list[int] = self._shard[start:stop].tolist()
        return indices


# At most this many micro-batches, and this many bytes, are gathered from a TensorDataset at once.
_MAX_GATHERED_MICRO_BATCHES = 64
_MAX_GATHERED_BYTES = 16 * 2**20


def _micro_batches_per_gather(tensors: tuple[Tensor, ...], batch_size: int) -> int:
    """How many micro-batches one gather from ``tensors`` reads, within the bounds above."""
    # The reader reads only from a shard with a step, so every tensor has a first row here.
    example_bytes = sum(tensor[0].nbytes for tensor in tensors)
    fitting = _MAX_GATHERED_BYTES // max(example_bytes * batch_size, 1)
    return max(1, min(_MAX_GATHERED_MICRO_BATCHES, fitting))


def _describe(values: Mapping[str, object]) -> str:
    return ", ".join(f"{name} {value}" for name, value in values.items())
