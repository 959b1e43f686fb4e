"""A sparse embedding table trained by SparseAdam beside a dense head trained by AdamW (two
param groups, two LR schedulers), under ``torchrun`` or in-process.

Usage: ``train_sparse.py OUTPUT_DIR JSON_OPTIONS``. Rank 0 writes the full parameters and each
optimizer's state dict to ``OUTPUT_DIR/result.pt``. With ``sigkill_after_step`` the last rank
SIGKILLs itself after that step (a checkpoint of an earlier step is on disk by then). With
``reference_first`` the launch first trains the same run without the kill, to its end, in
``OUTPUT_DIR/reference`` (one launch instead of two on a small machine).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import MapDataReader, Trainer, TrainerCallback, apply_data_parallel, unwrap_model
from tests.workers.leave import leave
from units import TrainUnit

NUM_ROWS = 40


class SparseDataset(torch.utils.data.Dataset[tuple[Tensor, Tensor]]):
    """Three row ids and one regression target per example."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(99)
        self.ids = torch.randint(0, NUM_ROWS, (size, 3), generator=gen)
        self.y = torch.randn(size, generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.ids[index], self.y[index]


@dataclass
class SparseBatch:
    ids: Tensor
    y: Tensor

    @property
    def batch_size(self) -> int:
        return len(self.y)


def collate(examples: list[tuple[Tensor, Tensor]]) -> SparseBatch:
    return SparseBatch(torch.stack([e[0] for e in examples]), torch.stack([e[1] for e in examples]))


class SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(NUM_ROWS, 8, sparse=True)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(self.table(ids).sum(1)))).squeeze(-1)


class SparseUnit(TrainUnit[SparseBatch]):
    """Summed squared error; with ``nan_sparse_at_step``, that step's gradient of the table (and
    nothing else) is NaN while the loss stays finite."""

    def __init__(self, model: nn.Module, *, nan_sparse_at_step: int | None = None) -> None:
        super().__init__(model)
        self._nan_step = nan_sparse_at_step
        self._step_nr = 0

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def __call__(self, batch: SparseBatch) -> tuple[Tensor, int | None]:
        loss = (self.model(batch.ids) - batch.y).pow(2).sum()
        if self._step_nr == self._nan_step:
            # sqrt at 0: the value 0 and an infinite slope, so a NaN gradient for the rows only.
            rows = unwrap_model(self.model).table(batch.ids)  # type: ignore[operator]
            loss = loss + torch.sqrt(rows.sum() * 0.0)
        return loss, batch.batch_size


def make_optimizers(model: SparseModel) -> tuple[list[torch.optim.Optimizer], list[LRScheduler]]:
    """SparseAdam for the table; AdamW for the head, with a learning rate per layer."""
    sparse = torch.optim.SparseAdam([model.table.weight], lr=0.05)
    dense = torch.optim.AdamW(
        [{"params": model.up.parameters(), "lr": 0.01}, {"params": model.down.parameters()}],
        lr=0.03,
    )
    schedulers: list[LRScheduler] = [
        StepLR(dense, step_size=2, gamma=0.5),
        LambdaLR(sparse, lambda step: 1.0 / (1 + step)),
    ]
    return [dense, sparse], schedulers


class KillAfter(TrainerCallback):
    def __init__(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def on_step_end(self, *, step_nr: int, **_: Any) -> None:
        if step_nr == self._step_nr:
            os.kill(os.getpid(), signal.SIGKILL)


def make_trainer(
    output_dir: Path, options: dict[str, Any], gangs: Gangs
) -> tuple[Trainer[SparseBatch], SparseModel, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    module = SparseModel()
    model = apply_data_parallel(module, gangs)
    optimizers, schedulers = make_optimizers(module)
    reader = MapDataReader(
        dataset=SparseDataset(64),
        batch_size=options["batch_size"],
        collate=collate,
        gang=gangs.dp,
        num_accumulate=options.get("num_accumulate", 1),
        shuffle=False,
    )
    callbacks = []
    kill_step = options.get("sigkill_after_step")
    if kill_step is not None and gangs.root.rank == gangs.root.size - 1:
        callbacks.append(KillAfter(kill_step))
    trainer = Trainer(
        unit=SparseUnit(model, nan_sparse_at_step=options.get("nan_sparse_at_step")),
        data_reader=reader,
        optimizer=optimizers,
        lr_scheduler=schedulers,
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=options.get("max_num_steps", 6),
        max_gradient_norm=options.get("max_gradient_norm"),
        checkpoint_every_n_steps=options.get("checkpoint_every"),
        publish_metrics_every_n_steps=1,
        metrics_dir=output_dir / "metrics",
        dtype=getattr(torch, options.get("dtype", "float32")),
        reshard_on_resume=options.get("reshard_on_resume", False),
        callbacks=callbacks,
        progress=False,
    )
    return trainer, module, optimizers


def result_of(module: SparseModel, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    return {
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizers": [o.state_dict() for o in optimizers],
    }


def train(output_dir: Path, options: dict[str, Any], gangs: Gangs) -> Trainer[SparseBatch]:
    """One run to its end (or its kill); rank 0 writes ``output_dir/result.pt``."""
    trainer, module, optimizers = make_trainer(output_dir, options, gangs)
    trainer.run()
    if gangs.root.rank == 0:
        torch.save(result_of(module, optimizers), output_dir / "result.pt")
    return trainer


def main(output_dir: Path, options: dict[str, Any]) -> None:
    gangs = setup_gangs()
    if options.get("reference_first"):
        reference = {k: v for k, v in options.items() if k != "sigkill_after_step"}
        train(output_dir / "reference", reference, gangs).close()
    leave(gangs.root, train(output_dir, options, gangs))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
