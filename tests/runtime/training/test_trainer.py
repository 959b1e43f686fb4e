"""The step loop in one process: normalization, errors, epochs, metrics out."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from checkpoint import CheckpointManager
from gangs import Gangs
from runtime import MapDataReader, NonFiniteError, Trainer, TrainerError
from runtime.training.step import _num_examples
from tests.conftest import make_toy_trainer, read_jsonl
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate
from units import TrainUnit


def manual_update(
    model: nn.Module, batches: list[ToyBatch], *, mean_loss: bool, lr: float
) -> dict[str, Tensor]:
    """The expected SGD step, computed by hand."""
    model.zero_grad()
    if mean_loss:
        for batch in batches:
            loss = ((model(batch.x) - batch.y).pow(2) * batch.mask).sum() / batch.num_targets
            (loss / len(batches)).backward()
    else:
        total = sum(b.num_targets for b in batches)
        for batch in batches:
            (((model(batch.x) - batch.y).pow(2) * batch.mask).sum() / total).backward()
    with torch.no_grad():
        return {n: p - lr * p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mean_loss", [False, True], ids=["summed_loss", "num_targets_none"])
def test_accumulated_step_is_the_normalized_mean(tmp_path: Path, mean_loss: bool) -> None:
    torch.manual_seed(0)
    reference = ToyModel()
    dataset = ToyDataset(32)
    batches = [collate([dataset[i] for i in range(j, j + 4)]) for j in (0, 4)]
    expected = manual_update(reference, batches, mean_loss=mean_loss, lr=0.1)

    trainer = make_toy_trainer(tmp_path, num_accumulate=2, unit_kwargs={"mean_loss": mean_loss})
    trainer.run()
    model = trainer._unit.model
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], msg=name)


def test_zero_targets_is_a_clear_error(tmp_path: Path) -> None:
    trainer = make_toy_trainer(tmp_path, unit_kwargs={"zero_targets": True})
    with pytest.raises(TrainerError, match="step 1 have no targets on any data-parallel rank"):
        trainer.run()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_steps": -3}, "max_num_steps must be greater than zero, but is -3 instead."),
        ({"max_num_data_epochs": 0}, "max_num_data_epochs must be greater than zero, but is 0"),
        ({"publish_metrics_every_n_steps": 0}, "publish_metrics_every_n_steps must be greater"),
        ({"max_gradient_norm": -1.0}, "max_gradient_norm must be greater than zero, but is -1.0"),
        ({"dtype": torch.int32}, "dtype must be torch.float32, torch.bfloat16 or torch.float16"),
        ({"keep_best_n_checkpoints": 2}, "rank by a validation score"),
        (
            {"checkpoint_every_n_steps": 2, "keep_checkpoint_every_n_steps": 5},
            "keep_checkpoint_every_n_steps (5) keeps the checkpoints of its multiples, so it must "
            "be a multiple of checkpoint_every_n_steps (2)",
        ),
        ({"keep_checkpoint_every_n_steps": 0}, "keep_checkpoint_every_n_steps must be greater"),
        ({"fp16_loss_scale": (1.0, 2.0)}, "fp16_loss_scale must be"),
    ],
)
def test_bad_arguments_are_clear_errors(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        make_toy_trainer(tmp_path, **kwargs)


def test_epochs_end_reset_the_reader_and_carry_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 32 examples / batch 4 = 8 steps an epoch; 3 epochs = 24 steps, though 100 are allowed.
    trainer = make_toy_trainer(
        tmp_path,
        max_num_steps=100,
        max_num_data_epochs=3,
        metrics_dir=tmp_path / "metrics",
        publish_metrics_every_n_steps=8,
    )
    with caplog.at_level(logging.INFO):
        assert trainer.run() == 0
    assert trainer.step_nr == 24
    records = [
        json.loads(line) for line in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()
    ]
    assert [r["step_nr"] for r in records] == [8, 16, 24]
    assert [r["data_epoch"] for r in records] == [1, 2, 3]


def test_published_metrics_describe_the_window(tmp_path: Path) -> None:
    trainer = make_toy_trainer(
        tmp_path, max_num_steps=6, metrics_dir=tmp_path / "metrics", publish_metrics_every_n_steps=4
    )
    trainer.run()
    records = [
        json.loads(line) for line in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()
    ]
    assert [r["step_nr"] for r in records] == [4, 6]  # the end of training publishes the rest
    first = records[0]
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "targets_per_second",
        "batch_size",
        "data_epoch",
        "elapsed_time",
        "data_wait_time",
        "toy_loss",
        "num_targets",
    ):
        assert key in first, key
    assert first["batch_size"] == 4
    assert first["lr"] == pytest.approx(0.1)
    # The unit's own mean-per-target loss and the Trainer's agree.
    assert first["toy_loss"] == pytest.approx(first["loss"], rel=1e-5)
    assert records[1]["num_steps"] == 2


def test_gradient_clipping_bounds_the_update(tmp_path: Path) -> None:
    torch.manual_seed(0)
    before = {n: p.detach().clone() for n, p in ToyModel().named_parameters()}
    trainer = make_toy_trainer(tmp_path, max_gradient_norm=1e-3, lr=1.0)
    trainer.run()
    after = dict(trainer._unit.model.named_parameters())
    step = torch.cat([(after[n].detach() - before[n]).flatten() for n in before])
    assert step.norm().item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize(
    ("batch", "num_examples"),
    [
        ([torch.zeros(5, 3), torch.zeros(5)], 5),  # default_collate of (input, label) examples
        ({"x": torch.zeros(6, 2), "y": torch.zeros(6), "id": ["a"] * 6}, 6),
        ((torch.zeros(7, 2), ["text"] * 7), 7),
        ([torch.zeros(3), torch.zeros(5)], 2),  # per-example sequences of several lengths
        (["a", "b", "c"], 3),
        (object(), 0),
    ],
)
def test_the_examples_of_a_micro_batch_are_counted_on_its_first_dimension(
    batch: object, num_examples: int
) -> None:
    assert _num_examples(batch) == num_examples


def test_a_tensor_dataset_publishes_its_batch_size(tmp_path: Path) -> None:
    gangs = Gangs.single()
    model = nn.Linear(3, 2)
    dataset = TensorDataset(torch.randn(24, 3), torch.randint(0, 2, (24,)))

    class Classify(TrainUnit[list[Tensor]]):
        def __call__(self, batch: list[Tensor]) -> tuple[Tensor, int | None]:
            inputs, labels = batch
            loss = nn.functional.cross_entropy(self.model(inputs), labels, reduction="sum")
            return loss, labels.numel()

    Trainer(
        unit=Classify(model),
        data_reader=MapDataReader(dataset=dataset, batch_size=6, gang=gangs.dp, seed=0),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        checkpoint_manager=CheckpointManager(tmp_path / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=2,
        metrics_dir=tmp_path / "metrics",
        progress=False,
    ).run()
    (record,) = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert record["batch_size"] == 6 and record["num_targets"] == 12


def published_train_metrics(output_dir: Path, **kwargs: Any) -> dict[int, dict[str, Any]]:
    make_toy_trainer(output_dir, metrics_dir=output_dir / "metrics", **kwargs).run()
    return {r["step_nr"]: r for r in read_jsonl(output_dir / "metrics" / "train.jsonl")}


def test_grad_norm_is_measured_on_publishing_steps_and_on_every_step_with_clipping(
    tmp_path: Path,
) -> None:
    every = published_train_metrics(
        tmp_path / "every", max_num_steps=8, publish_metrics_every_n_steps=1
    )
    sampled = published_train_metrics(
        tmp_path / "sampled", max_num_steps=8, publish_metrics_every_n_steps=4
    )
    # Clipping that never clips measures every step, and trains as the others do.
    clipped = published_train_metrics(
        tmp_path / "clipped",
        max_num_steps=8,
        publish_metrics_every_n_steps=4,
        max_gradient_norm=1e9,
    )
    assert sorted(sampled) == sorted(clipped) == [4, 8]
    for step_nr in (4, 8):
        assert sampled[step_nr]["grad_norm"] == every[step_nr]["grad_norm"]
        window = [every[s]["grad_norm"] for s in range(step_nr - 3, step_nr + 1)]
        assert len(set(window)) == 4
        assert clipped[step_nr]["grad_norm"] == pytest.approx(sum(window) / 4, rel=1e-6)


def test_a_window_the_data_ends_has_no_grad_norm_if_none_of_its_steps_measured_one(
    tmp_path: Path,
) -> None:
    # 32 examples in batches of 4: the data ends after step 8, which no schedule names.
    records = published_train_metrics(
        tmp_path, max_num_steps=None, max_num_data_epochs=1, publish_metrics_every_n_steps=3
    )
    assert sorted(records) == [3, 6, 8]
    assert "grad_norm" in records[3] and "grad_norm" in records[6]
    assert "grad_norm" not in records[8] and records[8]["num_steps"] == 2


class NanInBackward(ToyUnit):
    """sqrt at 0 has an infinite gradient, so backward produces NaN."""

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        loss, num_targets = super().__call__(batch)
        return loss + torch.sqrt(loss * 0.0), num_targets


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.filterwarnings("ignore:Error detected in MulBackward0")
def test_anomaly_detection_names_the_backward_that_made_nan(tmp_path: Path) -> None:
    unit = NanInBackward(ToyModel(), mean_loss=False, zero_targets=False)
    # Without it, the non-finite guard stops the run, but cannot say which backward made the NaN.
    with pytest.raises(NonFiniteError, match="The gradients were not finite at step 1 on rank 0"):
        make_toy_trainer(tmp_path / "off", unit=unit).run()
    assert not (tmp_path / "off" / "checkpoints" / "step_1").exists()

    unit = NanInBackward(ToyModel(), mean_loss=False, zero_targets=False)
    trainer = make_toy_trainer(tmp_path / "on", unit=unit, anomaly_detection=True)
    with pytest.raises(RuntimeError, match=r"Function '\w+Backward0' returned nan values"):
        trainer.run()


class DtypeProbe(ToyUnit):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, mean_loss=False, zero_targets=False)
        self.output_dtypes: list[torch.dtype] = []

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        self.output_dtypes.append(self.model(batch.x).dtype)
        return super().__call__(batch)


@pytest.mark.parametrize(
    ("dtype", "amp", "expected"),
    [
        (torch.bfloat16, True, torch.bfloat16),
        (torch.bfloat16, False, torch.float32),
        (torch.float32, True, torch.float32),
    ],
)
def test_amp_autocasts_the_forward_to_dtype(
    tmp_path: Path, dtype: torch.dtype, amp: bool, expected: torch.dtype
) -> None:
    unit = DtypeProbe(ToyModel())
    trainer = make_toy_trainer(tmp_path, unit=unit, dtype=dtype, amp=amp, max_num_steps=2)
    assert trainer.run() == 0
    assert unit.output_dtypes == [expected, expected]
    # The master weights stay in float32; autocast only changes the compute.
    assert {p.dtype for p in unit.model.parameters()} == {torch.float32}


def params_of(trainer: Trainer[ToyBatch]) -> list[Tensor]:
    return [p.detach().clone() for p in trainer._unit.model.parameters()]


def test_a_finished_run_trains_on_when_max_num_steps_grows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    straight = make_toy_trainer(tmp_path / "straight", max_num_steps=6)
    straight.run()

    assert make_toy_trainer(tmp_path / "extended", max_num_steps=4).run() == 0
    same_limit = make_toy_trainer(tmp_path / "extended", max_num_steps=4)
    with caplog.at_level(logging.INFO):
        same_limit.run()
    assert same_limit.step_nr == 4
    assert "The run finished at step 4 already; nothing to do." in caplog.messages

    extended = make_toy_trainer(tmp_path / "extended", max_num_steps=6)
    with caplog.at_level(logging.INFO):
        assert extended.run() == 0
    assert extended.step_nr == 6
    assert any("now allow more: training on" in m for m in caplog.messages)
    for actual, expected in zip(params_of(extended), params_of(straight), strict=True):
        assert torch.equal(actual, expected)


def test_a_finished_run_trains_on_when_max_num_data_epochs_grows(tmp_path: Path) -> None:
    # 32 examples / batch 4 = 8 steps an epoch.
    first = make_toy_trainer(tmp_path, max_num_steps=None, max_num_data_epochs=1)
    first.run()
    assert first.step_nr == 8
    again = make_toy_trainer(tmp_path, max_num_steps=None, max_num_data_epochs=2)
    again.run()
    assert again.step_nr == 16
