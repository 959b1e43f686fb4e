"""A toy run with a poisoned example, for the loss-spike rollback tests (in process or under
``torchrun``).

Usage: ``train_spike.py OUTPUT_DIR JSON_RUNS``: each run of the mapping trains in
``OUTPUT_DIR/NAME`` with its options, one after the other in one launch. The data is the toy
data, unshuffled, less the examples ``drop`` ([start, end)) names; the examples
``poison_indices`` (of the full data) scale the loss of their micro-batch by ``poison_factor``.
Rank 0 saves the parameters to ``params.pt``, and every rank the exit status (or the message of
a ``LossSpikeError``) and the steps ``on_rollback`` saw to ``rollbacks_R.json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import (
    LossSpikeError,
    LossSpikeGuard,
    MapDataReader,
    Trainer,
    TrainerCallback,
    apply_data_parallel,
)
from tests.workers.leave import leave
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit


class SpikyDataset(torch.utils.data.Dataset[dict[str, Tensor]]):
    """The toy data less the examples of ``drop``, one of them poisoned by ``factor``."""

    def __init__(
        self, size: int, *, poison_indices: list[int], factor: float, drop: list[int]
    ) -> None:
        self._data = ToyDataset(size)
        start, end = drop or (0, 0)
        self._indices = [i for i in range(size) if not start <= i < end]
        self._poison_indices = set(poison_indices)
        self._factor = factor

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        original = self._indices[index]
        factor = self._factor if original in self._poison_indices else 1.0
        return {**self._data[original], "poison": torch.tensor(factor)}


@dataclass
class SpikyBatch(ToyBatch):
    poison: float = 1.0


def collate(examples: list[dict[str, Tensor]]) -> SpikyBatch:
    mask = torch.stack([e["mask"] for e in examples])
    return SpikyBatch(
        x=torch.stack([e["x"] for e in examples]),
        y=torch.stack([e["y"] for e in examples]),
        mask=mask,
        num_targets=int(mask.sum()),
        poison=float(torch.stack([e["poison"] for e in examples]).max()),
    )


class SpikyUnit(ToyUnit):
    """The summed toy loss, scaled by the batch's poison (a finite spike, or NaN)."""

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        loss, num_targets = super().__call__(batch)
        assert isinstance(batch, SpikyBatch)
        return (loss * batch.poison if batch.poison != 1.0 else loss), num_targets


class RollbackLog(TrainerCallback):
    def __init__(self) -> None:
        self.rollbacks: list[tuple[int, int]] = []

    def on_rollback(self, *, from_step: int, to_step: int) -> None:
        self.rollbacks.append((from_step, to_step))


def make_trainer(
    gangs: Gangs,
    output_dir: Path,
    options: dict[str, Any],
    callbacks: tuple[TrainerCallback, ...] = (),
) -> tuple[Trainer[Any], nn.Module, RollbackLog]:
    torch.manual_seed(0)
    model: nn.Module = ToyModel()
    if gangs.dp.size > 1:
        model = apply_data_parallel(model, gangs, kind="ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    dataset = SpikyDataset(
        options.get("dataset_size", 64),
        poison_indices=options.get("poison_indices", []),
        factor=options.get("poison_factor", 100.0),
        drop=options.get("drop", []),
    )
    reader = MapDataReader(
        dataset=dataset,
        batch_size=options.get("batch_size", 4),
        collate=collate,
        gang=gangs.dp,
        shuffle=False,
    )
    log = RollbackLog()
    guard = options.get("guard")
    trainer = Trainer(
        unit=SpikyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=reader,
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=options.get("max_num_steps", 10),
        publish_metrics_every_n_steps=options.get("publish_every", 2),
        checkpoint_every_n_steps=options.get("checkpoint_every", 4),
        metrics_dir=output_dir / "metrics",
        loss_spike_guard=None if guard is None else LossSpikeGuard(**guard),
        callbacks=[log, *callbacks],
        progress=False,
    )
    return trainer, model, log


def full_params(model: nn.Module) -> dict[str, Tensor]:
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {k.removeprefix("module."): v for k, v in state.items()}


def main(output_dir: Path, runs: dict[str, dict[str, Any]]) -> None:
    gangs = setup_gangs()
    trainers = []
    for name, options in runs.items():
        run_dir = output_dir / name
        trainer, model, log = make_trainer(gangs, run_dir, options)
        trainers.append(trainer)
        try:
            status: int | str = trainer.run()
        except LossSpikeError as ex:
            status = str(ex)
        params = full_params(model)
        rank = gangs.root.rank
        (run_dir / f"rollbacks_{rank}.json").write_text(json.dumps([status, log.rollbacks]))
        if rank == 0:
            torch.save(params, run_dir / "params.pt")
    leave(gangs.root, *trainers)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
