"""The batch a rank runs in place of the micro-batches it lacks in a step of an evaluation.

Under FSDP2, HSDP or TP a forward makes collectives (FSDP2 all-gathers each unit's parameters),
so a rank whose shard of the valid set ran out must still run a forward whenever another rank
does, or the ranks' collectives no longer match. It runs the unit on a stand-in batch instead,
and the unit's metric updates are discarded.
"""

from __future__ import annotations

import pickle
from typing import Any, final

import torch

from gangs import Gang, ReduceOperation
from runtime.data.data_reader import DataReaderError
from runtime.data.device import move_to_device, tensor_devices

_CPU = torch.device("cpu")


@final
class StandInBatch:
    """Keeps this rank's latest batch of an evaluation, for the forwards it lacks.

    A rank that has read no batch yet gets one from the lowest rank that has: one small
    all-reduce on the CPU at the first step tells every rank which ranks have a batch (the host
    never waits for the device for it), and only if some rank lacks one does the first that has
    one broadcast it, moved to the CPU.
    """

    def __init__(self, gang: Gang, *, num_accumulate: int) -> None:
        self._gang = gang
        self._num_accumulate = num_accumulate
        self._batch: Any = None
        self._agreed = gang.size == 1

    def update(self, batches: list[Any]) -> None:
        """Take note of a step's ``batches``; every rank of the gang calls it at every step."""
        if self._gang.size == 1:
            return  # no other rank to keep in step
        if len(batches) > self._num_accumulate:
            raise DataReaderError(
                f"The data reader gave {len(batches)} micro-batches in one step on rank "
                f"{self._gang.rank}, but its num_accumulate is {self._num_accumulate}. A step "
                "holds at most num_accumulate micro-batches (see DataReader.__next__)."
            )
        if batches:
            self._batch = batches[-1]
        if not self._agreed:
            self._agree()

    def num_missing(self, batches: list[Any]) -> int:
        """How many stand-in forwards complete this rank's step to ``num_accumulate`` forwards:
        none while no rank has read a batch (then no rank runs a forward)."""
        if self._gang.size == 1 or self._batch is None:
            return 0
        return self._num_accumulate - len(batches)

    @property
    def batch(self) -> Any:
        if self._batch is None:
            raise RuntimeError("No rank has read a batch yet, so there is no stand-in batch.")
        return self._batch

    def _agree(self) -> None:
        gang = self._gang
        # On the CPU whatever the gang's device: gloo carries it, and reading it never waits
        # for the device.
        holders = torch.zeros(gang.size, dtype=torch.int64, device=_CPU)
        holders[gang.rank] = int(self._batch is not None)
        gang.all_reduce(holders, ReduceOperation.MAX)
        ranks = holders.nonzero().flatten().tolist()
        if not ranks:
            return  # no rank has a batch yet, so none runs a forward: ask again next step
        self._agreed = True
        if len(ranks) < gang.size:
            self._share(source=ranks[0])

    def _share(self, *, source: int) -> None:
        """Broadcast ``source``'s batch, moved to the CPU, to the ranks that have none."""
        gang = self._gang
        payload: list[tuple[bool, bytes] | str | None] = [None]
        if gang.rank == source:
            on_device = any(device.type != "cpu" for device in tensor_devices(self._batch))
            try:
                # Pickled here, so a batch that does not pickle fails every rank, not one.
                payload[0] = (on_device, pickle.dumps(move_to_device(self._batch, _CPU)))
            except Exception as ex:
                payload[0] = f"{type(ex).__name__}: {ex}"
        gang.broadcast_objects(payload, source_rank=source)
        received = payload[0]
        if not isinstance(received, tuple):
            raise DataReaderError(
                f"Rank {source} of the data-parallel gang could not send its batch as the "
                f"stand-in batch of the ranks whose valid shard is empty: {received}. Evaluation "
                "sends a batch between ranks when the valid set has fewer micro-batches than "
                "there are ranks, so its batches must pickle; or use a larger valid set."
            )
        if self._batch is None:
            on_device, data = received
            # The bytes come from a rank of this same run.
            batch = pickle.loads(data)
            self._batch = move_to_device(batch, gang.device) if on_device else batch
