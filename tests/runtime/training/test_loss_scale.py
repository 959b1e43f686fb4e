"""fp16 dynamic loss scaling: overflowing steps are skipped, the scale backs off and grows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from runtime import LossScaler, NonFiniteError, TrainerCallback, TrainerError
from tests.conftest import make_toy_trainer
from tests.workers.train_toy import ToyBatch, ToyModel, ToyUnit


def test_disabled_scaler_is_the_identity_and_reads_nothing() -> None:
    scaler = LossScaler(init_scale=128.0, min_scale=1e-4, enabled=False)
    assert scaler.scale == 1.0
    # A disabled scaler must not read the norm: that would be a host sync per step.
    assert scaler.update(torch.tensor(math.inf), step_nr=1)


def test_overflow_halves_the_scale_and_good_steps_double_it() -> None:
    scaler = LossScaler(init_scale=8.0, min_scale=1.0, enabled=True, growth_interval=2)
    assert not scaler.update(torch.tensor(math.inf), step_nr=1)
    assert scaler.scale == 4.0
    assert scaler.update(torch.tensor(1.0), step_nr=2)
    assert scaler.scale == 4.0
    assert scaler.update(torch.tensor(1.0), step_nr=3)
    assert scaler.scale == 8.0


def test_scale_below_its_minimum_is_a_clear_error() -> None:
    scaler = LossScaler(init_scale=2.0, min_scale=1.0, enabled=True)
    assert not scaler.update(torch.tensor(math.nan), step_nr=1)
    with pytest.raises(NonFiniteError, match=r"fell below its minimum 1\.0 at step 2"):
        scaler.update(torch.tensor(math.nan), step_nr=2)


def test_state_round_trips() -> None:
    scaler = LossScaler(init_scale=8.0, min_scale=1.0, enabled=True, growth_interval=5)
    scaler.update(torch.tensor(math.inf), step_nr=1)
    scaler.update(torch.tensor(1.0), step_nr=2)
    restored = LossScaler(init_scale=8.0, min_scale=1.0, enabled=True, growth_interval=5)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() == {"scale": 4.0, "good_steps": 1}


class OverflowAt(ToyUnit):
    """A toy unit whose loss is infinite at one step, as an fp16 overflow makes it."""

    def __init__(self, model: torch.nn.Module, *, overflow_step: int) -> None:
        super().__init__(model, mean_loss=False, zero_targets=False)
        self._overflow_step = overflow_step
        self._step_nr = 0

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        loss, num_targets = super().__call__(batch)
        if self._step_nr == self._overflow_step:
            loss = loss * math.inf
        return loss, num_targets


class ParamSnapshots(TrainerCallback):
    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.by_step: dict[int, list[Tensor]] = {}

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        self.by_step[step_nr] = [p.detach().clone() for p in self._model.parameters()]


@pytest.mark.usefixtures("torch_private_apis")
def test_trainer_skips_an_overflowing_step_and_forgets_its_metrics(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ToyModel()
    snapshots = ParamSnapshots(model)
    trainer = make_toy_trainer(
        tmp_path,
        unit=OverflowAt(model, overflow_step=2),
        max_num_steps=3,
        dtype=torch.float16,
        fp16_loss_scale=(128.0, 1.0),
        publish_metrics_every_n_steps=3,
        metrics_dir=tmp_path / "metrics",
        callbacks=[snapshots],
    )
    assert trainer.run() == 0

    step1, step2, step3 = (snapshots.by_step[s] for s in (1, 2, 3))
    assert all(torch.equal(a, b) for a, b in zip(step1, step2, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(step2, step3, strict=True))
    for param in step3:
        assert torch.isfinite(param).all()

    (record,) = [json.loads(line) for line in (tmp_path / "metrics" / "train.jsonl").open()]
    assert record["loss_scale"] == 64.0
    # The unit's metric saw steps 1 and 3 only: the rolled-back update of step 2 was infinite.
    assert math.isfinite(record["toy_loss"])


def test_a_run_that_cannot_go_on_numerically_raises_one_error_type() -> None:
    # One class to catch for every numerical stop, and still a TrainerError.
    assert issubclass(NonFiniteError, TrainerError)
