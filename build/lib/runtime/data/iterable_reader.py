"""Reading per-epoch iterators of unknown length, in steps every rank agrees on."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, final, overload

from torch.utils.data import default_collate
from typing_extensions import override

from gangs import Gang, ReduceOperation, agree
from runtime.data.data_reader import DataReader, DataReaderError, SyncMode, int_entry
from trainkit_utils.arguments import check_positive

BatchT = TypeVar("BatchT")


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

        # MIN lets every rank continue only if all have a step, MAX if any has one; a failure
        # on one rank reaches all in the same reduction.
        until_first = self._sync_mode is SyncMode.UNTIL_FIRST
        any_failed, have_step = agree(
            self._gang,
            failed=error is not None,
            vote=int(bool(batches)),
            vote_op=ReduceOperation.MIN if until_first else ReduceOperation.MAX,
        )
        if error is not None:
            raise DataReaderError(
                f"Reading step {self._step_nr} of data epoch {self._epoch} failed on rank "
                f"{self._gang.rank}: {type(error).__name__}: {error}. The iterator or the "
                "collate function raised it; see the cause above."
            ) from error
        if any_failed:
            raise DataReaderError(
                f"Another rank of the data-parallel gang failed to read step {self._step_nr} of "
                f"data epoch {self._epoch}, so rank {self._gang.rank} stops too. The log of the "
                "failed rank has the cause."
            )
        if not have_step:
            self._epoch_done = True
            raise StopIteration

        self._step_nr += 1
        return batches

    @override
    def for_evaluation(self) -> IterableDataReader[BatchT]:
        if (
            not self._drop_remainder
            and self._num_accumulate == 1
            and self._sync_mode is SyncMode.UNTIL_LAST
        ):
            return self
        return IterableDataReader(
            make_iterator=self._make_iterator,
            batch_size=self._batch_size,
            gang=self._gang,
            collate=self._collate,
            drop_remainder=False,
            sync_mode=SyncMode.UNTIL_LAST,
        )

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
        epoch = int_entry(state, "epoch")
        step_nr = int_entry(state, "step_nr")
        num_examples = int_entry(state, "num_examples")
        epoch_done = bool(int_entry(state, "epoch_done"))
        gang_size = int_entry(state, "gang_size")
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
