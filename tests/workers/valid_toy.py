"""Eval units for the validation tests, and a toy recipe with validation for the command line.

The recipe runs as ``python -m tests.workers.valid_toy OUTPUT_DIR [--config k=v]... [--evaluate W]``
and under ``torchrun``: it trains :class:`ToyModel` and validates it with :class:`ToyEvalUnit`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torcheval.metrics import Mean, Sum

from checkpoint import CheckpointManager
from gangs import Gang, setup_gangs
from runtime import (
    DataReader,
    EarlyStopper,
    MapDataReader,
    PatienceEarlyStopper,
    SyncMode,
    Trainer,
    apply_data_parallel,
    main,
)
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate
from units import EvalUnit

log = logging.getLogger(__name__)


class ToyEvalUnit(EvalUnit[ToyBatch]):
    """Records the mean squared error per target and how many targets it saw."""

    def __init__(self, model: nn.Module, display_name: str | None = None) -> None:
        super().__init__(model, display_name=display_name)
        self.metric_bag.register_metric("mse", Mean())
        self.metric_bag.register_metric("num_targets", Sum())

    def __call__(self, batch: ToyBatch) -> None:
        errors = (self.model(batch.x) - batch.y).pow(2) * batch.mask
        self.metric_bag.mse.update(errors.sum() / batch.num_targets, weight=batch.num_targets)
        self.metric_bag.num_targets.update(torch.tensor(float(batch.num_targets)))


class ScriptedEvalUnit(EvalUnit[ToyBatch]):
    """Reports ``scores[step_nr]`` as ``score``: validation results a test chooses in advance."""

    def __init__(
        self, model: nn.Module, scores: Mapping[int, float], display_name: str | None = None
    ) -> None:
        super().__init__(model, display_name=display_name)
        self.metric_bag.register_metric("score", Mean())
        self._scores = scores
        self._step_nr = -1

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def __call__(self, batch: ToyBatch) -> None:
        self.metric_bag.score.update(torch.tensor(self._scores[self._step_nr]))


def make_valid_reader(gang: Gang, *, size: int = 10, batch_size: int = 4) -> DataReader[ToyBatch]:
    """Every example once, ranks padded with empty steps until the last one is done."""
    return MapDataReader(
        dataset=ToyDataset(size),
        batch_size=batch_size,
        collate=collate,
        gang=gang,
        shuffle=False,
        drop_remainder=False,
        sync_mode=SyncMode.UNTIL_LAST,
    )


@dataclass
class ValidToyConfig:
    max_num_steps: int = 8
    lr: float = 0.05
    validate_every_n_steps: int = 2
    checkpoint_every_n_steps: int = 2
    keep_best_n_checkpoints: int | None = None
    early_stop_patience: int | None = None
    early_stop_min_delta: float = 0.0
    stopper_fails_at_step: int | None = None
    """Use an early stopper that raises at this step instead (it runs on rank 0 only)."""
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    """With ``fsdp``, each Linear is a shard unit of its own."""
    valid_size: int = 11


def recipe(config: ValidToyConfig, output_dir: Path) -> Trainer[ToyBatch]:
    gangs = setup_gangs()
    torch.manual_seed(0)
    model = apply_data_parallel(
        ToyModel(), gangs, kind=config.data_parallel, fsdp_units=(nn.Linear,)
    )
    train_reader = MapDataReader(
        dataset=ToyDataset(64), batch_size=4, collate=collate, gang=gangs.dp, seed=3
    )
    early_stopper: EarlyStopper | None = None
    if config.early_stop_patience is not None:
        early_stopper = PatienceEarlyStopper(
            config.early_stop_patience, min_delta=config.early_stop_min_delta, lower_better=True
        )
    elif config.stopper_fails_at_step is not None:
        fail_at = config.stopper_fails_at_step

        def failing_stopper(step_nr: int, score: float) -> bool:
            if step_nr == fail_at:
                raise RuntimeError(f"the stopper broke at step {step_nr}")
            return False

        early_stopper = failing_stopper
    return Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=train_reader,
        optimizer=torch.optim.SGD(model.parameters(), lr=config.lr),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=config.max_num_steps,
        valid_units=[ToyEvalUnit(model)],
        valid_data_readers=[make_valid_reader(gangs.dp, size=config.valid_size)],
        validate_every_n_steps=config.validate_every_n_steps,
        checkpoint_every_n_steps=config.checkpoint_every_n_steps,
        keep_best_n_checkpoints=config.keep_best_n_checkpoints,
        score_metric_name="mse",
        lower_better=True,
        early_stopper=early_stopper,
        publish_metrics_every_n_steps=2,
        metrics_dir=output_dir / "metrics",
        tb_dir=output_dir / "tb",
        progress=False,
    )


if __name__ == "__main__":
    main(recipe, ValidToyConfig)
