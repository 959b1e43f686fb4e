"""The data side of sequence parallelism: each rank of an SP gang keeps its part of every
sequence of the batches that all of them read (:mod:`runtime.parallel.sequence` is the model
side).

The readers shard by the DP gang, and the ranks of one SP gang share a DP rank, so they read the
same batches; :class:`SequenceSplitReader` then keeps positions ``[r * n, (r + 1) * n)`` of each
sequence on SP rank ``r`` (``n = seq_len / sp_size``). Targets are the next tokens already
(``TextBatch.target_ids`` is shifted before any split), so no target is lost at a boundary.
``positions`` are kept as they are, or made (``0 .. seq_len - 1``) when the batch has none, so
rotary embeddings see global positions; ``document_ids`` stay whole, since attention sees the
whole sequence; ``num_targets`` counts this rank's targets (``IGNORE_INDEX`` ones excluded), so
the Trainer's sum over DP x SP is the batch's count. Padded batches (SFT's examples, padded to
the longest) get more padding on the right, without targets, up to a length ``sp_size``
divides; packed ones must have a ``seq_len`` it divides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch
from typing_extensions import override

from gangs import Gang
from runtime.data.data_reader import DataReader, DataReaderWrapper
from units.lm import IGNORE_INDEX

BatchT = TypeVar("BatchT")


def split_sequences(batch: BatchT, rank: int, size: int) -> BatchT:
    """This SP rank's part of ``batch``, a dataclass with ``input_ids`` and ``target_ids``
    (``[batch, seq_len]``) and optionally ``positions``, ``document_ids``, ``num_targets``."""
    if size == 1:
        return batch
    if not dataclasses.is_dataclass(batch) or isinstance(batch, type):
        raise TypeError(
            f"Sequence parallelism splits dataclass batches with input_ids and target_ids, but "
            f"got {type(batch).__name__}. Use a text reader's batches, or gang.sp_size 1."
        )
    input_ids, target_ids = batch.input_ids, batch.target_ids  # type: ignore[attr-defined]
    seq_len = input_ids.size(1)
    positions = getattr(batch, "positions", None)
    if seq_len % size != 0:
        if getattr(batch, "document_ids", None) is not None or positions is not None:
            raise ValueError(
                f"A batch of packed sequences of {seq_len} positions does not split over "
                f"sp_size {size}. Use a data.seq_len that sp_size divides."
            )
        # Padded examples (SFT): more padding on the right, with no target, changes nothing
        # that a causal model computes for the positions before it.
        extra = size - seq_len % size
        input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=0)
        target_ids = torch.nn.functional.pad(target_ids, (0, extra), value=IGNORE_INDEX)
        seq_len += extra
    n = seq_len // size
    part = slice(rank * n, (rank + 1) * n)
    targets = target_ids[:, part].contiguous()
    if positions is None:
        positions = torch.arange(seq_len, dtype=torch.long).expand(input_ids.size(0), -1)
    changes: dict[str, Any] = {
        "input_ids": input_ids[:, part].contiguous(),
        "target_ids": targets,
        "positions": positions[:, part].contiguous(),
    }
    if hasattr(batch, "num_targets"):
        # On the CPU, where readers make batches: no wait for a device.
        changes["num_targets"] = int((targets != IGNORE_INDEX).sum())
    return dataclasses.replace(batch, **changes)


class SequenceSplitReader(DataReaderWrapper[BatchT]):
    """``reader`` (sharded by the DP gang, so every rank of ``sp_gang`` reads the same batches)
    with each micro-batch cut to this SP rank's positions (:func:`split_sequences`). Wrap the
    reader itself, under any that moves batches to the device."""

    def __init__(self, reader: DataReader[BatchT], sp_gang: Gang) -> None:
        super().__init__(reader)
        self._gang = sp_gang

    @override
    def __next__(self) -> list[BatchT]:
        rank, size = self._gang.rank, self._gang.size
        return [split_sequences(batch, rank, size) for batch in next(self._reader)]

    @override
    def for_evaluation(self) -> DataReader[BatchT]:
        return SequenceSplitReader(self._reader.for_evaluation(), self._gang)

    def __getattr__(self, name: str) -> Any:
        # What else the wrapped reader offers (its dataset, its checks) stays reachable.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._reader, name)
