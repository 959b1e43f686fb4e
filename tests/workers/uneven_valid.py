"""``torchrun uneven_valid.py OUT JSON_OPTIONS``: evaluations over valid sets that do not split
evenly over the DP ranks, under a sharded layout, each next to its one-process value.

Options: ``layout`` (``fsdp``, ``hsdp`` on 2 x 2, ``fsdp_tp`` with TP 2, ``ddp``), ``sizes`` (the
valid set sizes to evaluate with ``evaluate_units`` through a MapDataReader), ``iterable_sizes``
(the same through an IterableDataReader), ``user_readers`` (the readers of
:class:`RaggedReader`), ``unpicklable`` (a batch that cannot be sent to the rank without one),
``trainer`` (a Trainer that validates and evaluates a checkpoint) and ``compile`` (the Linear
blocks compiled). Rank 0 writes ``OUT/result.json``; every rank waits for the collectives of the
others with a short timeout, so a mismatch fails fast.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from typing_extensions import override

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import (
    DataParallelKind,
    DataReader,
    DataReaderError,
    IterableDataReader,
    MapDataReader,
    Trainer,
    apply_data_parallel,
    apply_tensor_parallel,
    compile_blocks,
    evaluate_units,
)
from runtime.metrics.recorders import MetricRecorder
from tests.workers.leave import leave
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate
from tests.workers.valid_toy import ToyEvalUnit

BATCH_SIZE = 4


def expected(model: nn.Module, size: int) -> dict[str, float]:
    """The values of a ToyEvalUnit over the whole set, in one process."""
    dataset = ToyDataset(size)
    with torch.no_grad():
        errors = (model(dataset.x) - dataset.y).pow(2) * dataset.mask
    return {
        "mse": (errors.sum() / dataset.mask.sum()).item(),
        "num_targets": float(dataset.mask.sum()),
    }


class NoRecorder(MetricRecorder):
    @override
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        pass

    @override
    def close(self) -> None:
        pass


class RaggedReader(DataReader[ToyBatch]):
    """A user's reader over ``ToyDataset(size)``, sharded by hand: DP rank 0 reads three batches,
    the last DP rank ``last_batches`` (0 or 1) and the others one; a rank out of batches gets
    ``[]`` until rank 0 is done, and every rank stops after three steps."""

    def __init__(self, gangs: Gangs, *, last_batches: int) -> None:
        dp = gangs.dp
        self.size = 3 * BATCH_SIZE + dp.size - 2 + last_batches
        data = collate([ToyDataset(self.size)[i] for i in range(self.size)])
        rows = list(range(3 * BATCH_SIZE)) if dp.rank == 0 else [3 * BATCH_SIZE - 1 + dp.rank]
        if dp.rank == dp.size - 1 and dp.rank > 0 and last_batches == 0:
            rows = []
        starts = range(0, len(rows), BATCH_SIZE)
        self._batches = [_select(data, rows[start : start + BATCH_SIZE]) for start in starts]
        self._step_nr = 0

    def __next__(self) -> list[ToyBatch]:
        if self._step_nr == 3:
            raise StopIteration
        self._step_nr += 1
        return self._batches[self._step_nr - 1 : self._step_nr]  # [] once this rank ran out

    def reset(self) -> None:
        self._step_nr = 0

    def state_dict(self) -> dict[str, object]:
        return {"step_nr": self._step_nr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._step_nr = int(state["step_nr"])

    @property
    def num_accumulate(self) -> int:
        return 1


@dataclass
class UnpicklableBatch(ToyBatch):
    hook: Callable[[], None] = lambda: None


def unpicklable_failure(model: nn.Module, gangs: Gangs) -> list[str]:
    """Every rank's error when the one valid batch (rank 0's) cannot be sent to rank 1."""
    reader = MapDataReader(
        dataset=ToyDataset(1),
        batch_size=BATCH_SIZE,
        collate=lambda examples: UnpicklableBatch(**vars(collate(examples))),
        gang=gangs.dp,
    )
    try:
        evaluate(model, gangs, reader.for_evaluation())
        error = "no error"
    except DataReaderError as ex:
        error = str(ex)
    return gangs.root.all_gather_objects(error)


def _select(batch: ToyBatch, rows: list[int]) -> ToyBatch:
    mask = batch.mask[rows]
    return ToyBatch(x=batch.x[rows], y=batch.y[rows], mask=mask, num_targets=int(mask.sum()))


def iterable_reader(gangs: Gangs, size: int) -> IterableDataReader[ToyBatch]:
    """``ToyDataset(size)`` read as a stream, sharded by hand over the DP ranks."""
    dataset, dp = ToyDataset(size), gangs.dp
    return IterableDataReader(
        make_iterator=lambda epoch: (dataset[i] for i in range(dp.rank, size, dp.size)),
        batch_size=BATCH_SIZE,
        collate=collate,
        gang=dp,
    )


def evaluate(model: nn.Module, gangs: Gangs, reader: DataReader[Any]) -> dict[str, Any]:
    unit = ToyEvalUnit(model)
    results = evaluate_units(
        model=model,
        units=[unit],
        data_readers=[reader],
        gangs=gangs,
        step_nr=0,
        recorder=NoRecorder(),
    )
    return results["valid"]


def run_trainer(model: nn.Module, gangs: Gangs, out: Path) -> dict[str, Any]:
    """Validate at start and after one step (lr 0: the model stays as built), then evaluate
    the checkpoint of that step; the valid reader is built like a training reader and is
    smaller than one of its steps."""
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=MapDataReader(
            dataset=ToyDataset(64), batch_size=BATCH_SIZE, collate=collate, gang=gangs.dp
        ),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        checkpoint_manager=CheckpointManager(out / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=1,
        valid_units=[ToyEvalUnit(model)],
        valid_data_readers=[
            MapDataReader(
                dataset=ToyDataset(5), batch_size=BATCH_SIZE, collate=collate, gang=gangs.dp
            )
        ],
        validate_at_start=True,
        validate_every_n_steps=1,
        checkpoint_every_n_steps=1,
        score_metric_name="mse",
        lower_better=True,
        metrics_dir=out / "metrics",
        progress=False,
    )
    trainer.run()
    return trainer.evaluate_checkpoint("last")["eval"]


def main(out: Path, options: dict[str, Any]) -> None:
    layout = options["layout"]
    gangs = setup_gangs(
        tp_size=2 if layout == "fsdp_tp" else 1,
        dp_shard_size=2 if layout == "hsdp" else None,
        timeout=timedelta(seconds=60),
    )
    torch.manual_seed(0)
    reference = ToyModel()
    model = apply_tensor_parallel(
        copy.deepcopy(reference), gangs, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    kind: DataParallelKind = "hsdp" if layout == "hsdp" else "ddp" if layout == "ddp" else "fsdp"
    model = apply_data_parallel(model, gangs, kind=kind, fsdp_units=(nn.Linear,))
    result: dict[str, Any] = {"sizes": {}, "iterable_sizes": {}, "user_readers": {}}
    if options.get("compile"):
        result["compiled"] = compile_blocks(model, block_types=(nn.Linear,), backend="eager")
    for size in options.get("sizes", []):
        # Built as a training reader (shuffled, drop_remainder, UNTIL_FIRST) and read as the
        # Trainer reads a valid reader.
        reader = MapDataReader(
            dataset=ToyDataset(size),
            batch_size=BATCH_SIZE,
            collate=collate,
            gang=gangs.dp,
            seed=size,
        )
        result["sizes"][size] = [
            evaluate(model, gangs, reader.for_evaluation()),
            expected(reference, size),
        ]
    for size in options.get("iterable_sizes", []):
        iterable = iterable_reader(gangs, size).for_evaluation()
        result["iterable_sizes"][size] = [
            evaluate(model, gangs, iterable),
            expected(reference, size),
        ]
    for last_batches in options.get("user_readers", []):
        ragged = RaggedReader(gangs, last_batches=last_batches)
        result["user_readers"][last_batches] = [
            evaluate(model, gangs, ragged),
            expected(reference, ragged.size),
        ]
    if options.get("unpicklable"):
        result["unpicklable"] = unpicklable_failure(model, gangs)
    if options.get("trainer"):
        result["trainer"] = [run_trainer(model, gangs, out), expected(reference, 5)]
        result["trainer_valid"] = (out / "metrics" / "valid.jsonl").read_text()
    if gangs.root.rank == 0:
        (out / "result.json").write_text(json.dumps(result))
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
