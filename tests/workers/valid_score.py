"""The validation score of a fixed model on a valid set that no batch size or DP size divides,
for tests/runtime/training/test_validation.py.

Usage: ``valid_score.py OUTPUT_DIR``, under ``torchrun`` with any number of processes. The valid
reader is built with the arguments a user writes for training (the defaults drop the remainder
and stop with the first rank); each rank writes ``score_rank_N.json``: its values of the
validation before the first step.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from torcheval.metrics import Mean, Sum

from checkpoint import CheckpointManager
from gangs import setup_gangs
from runtime import MapDataReader, Trainer, TrainerCallback
from tests.workers.leave import leave
from units import EvalUnit, TrainUnit

NUM_EXAMPLES = 11
BATCH_SIZE = 3


def make_model() -> nn.Linear:
    torch.manual_seed(5)
    return nn.Linear(2, 1)


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(6)
    return TensorDataset(
        torch.randn(NUM_EXAMPLES, 2, generator=generator),
        torch.randn(NUM_EXAMPLES, 1, generator=generator),
    )


def squared_errors(model: nn.Module, batch: list[Tensor]) -> Tensor:
    x, y = batch
    return (model(x) - y).pow(2).squeeze(1)


class SquaredErrorUnit(EvalUnit[list[Tensor]]):
    """The mean squared error per example, and the number of examples seen."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("mse", Mean())
        self.metric_bag.register_metric("num_examples", Sum())

    def __call__(self, batch: list[Tensor]) -> None:
        errors = squared_errors(self.model, batch)
        self.metric_bag.mse.update(errors.mean(), weight=len(errors))
        self.metric_bag.num_examples.update(torch.tensor(float(len(errors))))


class SquaredErrorTrainUnit(TrainUnit[list[Tensor]]):
    def __call__(self, batch: list[Tensor]) -> tuple[Tensor, int | None]:
        errors = squared_errors(self.model, batch)
        return errors.sum(), len(errors)


class WriteFirstValidation(TrainerCallback):
    """Writes this rank's values of the validation before the first step."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def on_validation_end(
        self, *, step_nr: int, score: float | None, results: Mapping[str, Mapping[str, Any]]
    ) -> None:
        if step_nr == 0:
            values = {name: float(value) for name, value in results["valid"].items()}
            self._path.write_text(json.dumps(values))


def main(output_dir: Path) -> None:
    gangs = setup_gangs()
    model = make_model()
    trainer = Trainer(
        unit=SquaredErrorTrainUnit(model),
        data_reader=MapDataReader(dataset=make_dataset(), batch_size=1, gang=gangs.dp),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=1,
        valid_units=[SquaredErrorUnit(model)],
        valid_data_readers=[
            MapDataReader(dataset=make_dataset(), batch_size=BATCH_SIZE, gang=gangs.dp)
        ],
        validate_at_start=True,
        validate_every_n_steps=1,
        callbacks=[WriteFirstValidation(output_dir / f"score_rank_{gangs.root.rank}.json")],
        progress=False,
    )
    trainer.run()
    leave(gangs.root, trainer)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
