"""``torchrun --nproc-per-node N valid_score_worker.py OUT``: validate a fixed model over 23
examples with the reader arguments a user writes for training, at step 0, into OUT/metrics."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor, nn
from torcheval.metrics import Mean

from checkpoint import CheckpointManager
from gangs import setup_gangs
from runtime import MapDataReader, Trainer
from tests.workers.leave import leave
from units import EvalUnit, TrainUnit

NUM_EXAMPLES = 23


def dataset() -> torch.utils.data.StackDataset[dict[str, Tensor]]:
    x = torch.linspace(-1.0, 1.0, NUM_EXAMPLES)[:, None]
    return torch.utils.data.StackDataset(x=x, y=x * 3.0)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 1)


class SquaredError(EvalUnit[dict[str, Tensor]]):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("squared_error", Mean())

    def __call__(self, batch: dict[str, Tensor]) -> None:
        error = (self.model(batch["x"]) - batch["y"]).square().squeeze(-1)
        self.metric_bag.squared_error.update(error)


class Regression(TrainUnit[dict[str, Tensor]]):
    def __call__(self, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        loss = (self.model(batch["x"]) - batch["y"]).square().sum()
        return loss, batch["y"].numel()


def main(out: Path) -> None:
    gangs = setup_gangs(tp_size=1)
    net = model()
    trainer = Trainer(
        unit=Regression(net),
        data_reader=MapDataReader(dataset=dataset(), batch_size=2, gang=gangs.dp),
        optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
        checkpoint_manager=CheckpointManager(out / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=1,
        valid_units=[SquaredError(net)],
        # As the tutorial writes a training reader: drop_remainder and UNTIL_FIRST by default.
        valid_data_readers=[MapDataReader(dataset=dataset(), batch_size=4, gang=gangs.dp)],
        validate_at_start=True,
        validate_every_n_steps=1,
        metrics_dir=out / "metrics",
        progress=False,
    )
    trainer.run()
    leave(gangs.root, trainer)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
