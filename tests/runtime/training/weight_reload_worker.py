"""``torchrun --nproc-per-node 2 weight_reload_worker.py DIR``: DDP on the toy model, reloading
``DIR/bank.pt`` after step 2 of 2; each rank writes its weights to ``DIR/after_RANK.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from checkpoint import CheckpointManager
from gangs import setup_gangs
from runtime import MapDataReader, ReloadInitialWeights, Trainer, apply_data_parallel, unwrap_model
from tests.workers.leave import leave
from tests.workers.train_toy import ToyDataset, ToyModel, ToyUnit, collate


def main(directory: Path) -> None:
    gangs = setup_gangs(tp_size=1)
    torch.manual_seed(0)
    model = apply_data_parallel(ToyModel(), gangs, kind="ddp")
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=MapDataReader(
            dataset=ToyDataset(64), batch_size=4, collate=collate, gang=gangs.dp
        ),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        checkpoint_manager=CheckpointManager(directory / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=2,
        callbacks=[
            ReloadInitialWeights(model, directory / "bank.pt", gangs=gangs, every_n_steps=2)
        ],
        progress=False,
    )
    trainer.run()
    weights = unwrap_model(model).state_dict()
    torch.save(weights, directory / f"after_{gangs.root.rank}.pt")
    leave(gangs.root, trainer)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
