"""The DataReader contract: sharded, resumable streams of micro-batches, one list of them per step.

A :class:`DataReader` is what the Trainer iterates: every ``next`` returns the ``num_accumulate``
micro-batches of one optimizer step, and ``StopIteration`` marks the end of a data epoch on every
rank of the data-parallel gang at the same step, so no rank waits in a collective for a rank that
ran out of data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, Generic, TypeVar

import torch
from typing_extensions import Self

BatchT = TypeVar("BatchT")


class DataReaderError(RuntimeError):
    """Raised when reading a step fails, or when the ranks disagree on the data."""


class WaitInterrupted(Exception):
    """Raised on every rank by :meth:`DataReader.has_next_epoch` when a stop was requested on
    some rank while the reader waited for data: the Trainer then stops as preempted."""


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

    def has_next_epoch(
        self, *, wait: bool = True, stop_requested: Callable[[], bool] | None = None
    ) -> bool:
        """Whether another data epoch follows the one being read (for a reader that has not
        read yet: whether a first one comes); :meth:`reset` (or the first ``next``) starts it.

        The Trainer asks on every rank before each data epoch; False ends the training with
        ``StopReason.END_OF_DATA``. The answer must be the same on every rank. A reader of a
        stream that grows while the run trains may have to wait to know: with ``wait=False`` it
        answers at once, True unless the stream has certainly ended. While it waits it calls
        ``stop_requested`` (when given) and raises :class:`WaitInterrupted` on every rank once
        that returned True on any rank, so a preempted run does not hang in the wait.

        The default is True: an ordinary reader's epochs never run out, and ``max_num_steps`` or
        ``max_num_data_epochs`` ends the training.
        """
        return True

    def for_evaluation(self) -> DataReader[BatchT]:
        """This data read the way validation and evaluation read it: every example once, the
        last partial micro-batch kept, one micro-batch a step, and ``[]`` on a rank whose shard
        ran out until the last rank is done (:attr:`SyncMode.UNTIL_LAST`), so a score is the
        mean over the whole set whatever the batch size and the number of ranks.

        The Trainer calls it on its valid readers. The default is the reader itself: a reader of
        your own must read its whole set this way, or raise ``ValueError`` saying how to. The
        evaluation keeps a rank that reads ``[]`` in step with the others (it runs the unit on a
        stand-in batch whose values are discarded), so such a reader must end with
        ``StopIteration`` on every rank at the same step and never skip a step on one rank.
        """
        return self


class DataReaderWrapper(DataReader[BatchT]):
    """A reader that changes what another one reads (moves it, splits it, repeats it): by
    default every part of the contract but :meth:`__next__` is ``reader``'s. A wrapper whose
    position differs from ``reader``'s (one that reads ahead or repeats) overrides the state."""

    def __init__(self, reader: DataReader[BatchT]) -> None:
        self._reader = reader

    @property
    def reader(self) -> DataReader[BatchT]:
        """The reader whose batches this one changes."""
        return self._reader

    def reset(self) -> None:
        self._reader.reset()

    def state_dict(self) -> dict[str, object]:
        return self._reader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reader.load_state_dict(state)

    @property
    def num_accumulate(self) -> int:
        return self._reader.num_accumulate

    def close(self) -> None:
        self._reader.close()

    def has_next_epoch(
        self, *, wait: bool = True, stop_requested: Callable[[], bool] | None = None
    ) -> bool:
        return self._reader.has_next_epoch(wait=wait, stop_requested=stop_requested)


def int_entry(state: Mapping[str, Any], key: str) -> int:
    """The integer ``key`` of a saved reader state, or a ValueError that says what is wrong."""
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


def divide(count: int, size: int, drop_remainder: bool) -> int:
    """How many groups of ``size`` make ``count``: whole ones only, or the last partial one too."""
    return count // size if drop_remainder else -(-count // size)
