"""Validation inside the Trainer: cadence, values on disk, scores, keep-best and early stopping.

Single-process runs of the toy model; the 2-rank early-stopping run is at the end of the file.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from checkpoint import CheckpointManager
from gangs import FakeGang, Gangs
from runtime import PatienceEarlyStopper, Trainer, TrainerCallback
from tests.conftest import (
    RunTorch,
    assert_ok,
    make_toy_trainer,
    read_jsonl,
    read_scalars,
    torchrun,
)
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate
from tests.workers.valid_toy import ScriptedEvalUnit, ToyEvalUnit, make_valid_reader
from units import EvalUnit

UnitsFactory = Callable[[nn.Module], Sequence[EvalUnit[Any]]]

# 32 training examples in batches of 4: a data epoch is 8 steps.


def make_trainer(
    tmp_path: Path,
    *,
    units: UnitsFactory | None = None,
    unit: ToyUnit | None = None,
    model: nn.Module | None = None,
    **kwargs: Any,
) -> Trainer[ToyBatch]:
    """A toy Trainer that validates: a ToyEvalUnit unless ``units`` makes others, a reader each."""
    if model is None:
        torch.manual_seed(0)
        model = unit.model if unit is not None else ToyModel()
    valid_units = list(units(model) if units is not None else [ToyEvalUnit(model)])
    kwargs.setdefault("max_num_steps", 6)
    kwargs.setdefault("metrics_dir", tmp_path / "metrics")
    kwargs.setdefault("tb_dir", tmp_path / "tb")
    kwargs.setdefault("valid_data_readers", [make_valid_reader(FakeGang()) for _ in valid_units])
    return make_toy_trainer(
        tmp_path,
        unit=unit or ToyUnit(model, mean_loss=False, zero_targets=False),
        lr=0.05,
        valid_units=valid_units,
        **kwargs,
    )


def valid_steps(tmp_path: Path, run: str = "valid") -> list[int]:
    return [r["step_nr"] for r in read_jsonl(tmp_path / "metrics" / f"{run}.jsonl")]


def checkpoint_steps(tmp_path: Path) -> list[int]:
    return sorted(
        int(p.name.removeprefix("step_"))
        for p in (tmp_path / "checkpoints").iterdir()
        if p.name.startswith("step_") and (p / "manifest.json").is_file()
    )


def manifest(tmp_path: Path, step_nr: int) -> dict[str, Any]:
    data = json.loads((tmp_path / "checkpoints" / f"step_{step_nr}" / "manifest.json").read_text())
    assert isinstance(data, dict)
    return data


def scripted(scores: Mapping[int, float], name: str | None = None) -> UnitsFactory:
    return lambda model: [ScriptedEvalUnit(model, scores, display_name=name)]


class SimulatedCrash(Exception):
    pass


class CrashAt(TrainerCallback):
    """Simulates a crash right after step ``step_nr`` (and so after its checkpoint)."""

    def __init__(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def on_checkpoint_saved(self, *, step_nr: int, checkpoint_dir: Path) -> None:
        if step_nr == self._step_nr:
            raise SimulatedCrash(f"simulated crash after step {step_nr}")


# ------------------------------------------------------------------------------ cadence


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"validate_every_n_steps": 2, "max_num_steps": 7}, [2, 4, 6, 7]),
        (
            {"validate_every_n_steps": 2, "validate_after_n_steps": 3, "max_num_steps": 9},
            [4, 6, 8, 9],
        ),
        # The last step validated on schedule: no second validation at the end.
        ({"validate_every_n_steps": 3, "validate_at_start": True}, [0, 3, 6]),
        (
            {"validate_every_n_data_epochs": 1, "max_num_data_epochs": 3, "max_num_steps": None},
            [8, 16, 24],
        ),
        (
            {"validate_every_n_data_epochs": 2, "max_num_data_epochs": 3, "max_num_steps": None},
            [16, 24],
        ),
        # Epoch ends validate even when the step schedule would not.
        (
            {"validate_every_n_steps": 5, "validate_every_n_data_epochs": 1, "max_num_steps": 12},
            [5, 8, 10, 12],
        ),
    ],
    ids=["every_n_steps", "after_n_steps", "at_start", "every_epoch", "every_2_epochs", "both"],
)
def test_validation_cadence(tmp_path: Path, kwargs: dict[str, Any], expected: list[int]) -> None:
    trainer = make_trainer(tmp_path, **kwargs)
    assert trainer.run() == 0
    assert valid_steps(tmp_path) == expected


class ModeRecordingEvalUnit(ToyEvalUnit):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.modes: list[tuple[bool, bool, bool]] = []

    def __call__(self, batch: ToyBatch) -> None:
        self.modes.append(
            (self.model.training, torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        )
        super().__call__(batch)


class ModeRecordingTrainUnit(ToyUnit):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, mean_loss=False, zero_targets=False)
        self.modes: list[tuple[bool, bool]] = []

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        self.modes.append((self.model.training, torch.is_inference_mode_enabled()))
        return super().__call__(batch)


def test_validation_runs_in_eval_mode_without_grad_and_training_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ToyModel()
    eval_unit = ModeRecordingEvalUnit(model)
    train_unit = ModeRecordingTrainUnit(model)
    trainer = make_trainer(
        tmp_path,
        model=model,
        unit=train_unit,
        units=lambda _: [eval_unit],
        validate_every_n_steps=2,
        validate_at_start=True,
    )
    assert trainer.run() == 0
    # 10 examples in batches of 4 = 3 batches, at steps 0, 2, 4 and 6. Not inference mode: its
    # tensors could not be updated in place by the training after it.
    assert eval_unit.modes == [(False, False, False)] * 12
    assert train_unit.modes == [(True, False)] * 6
    assert model.training


def test_values_of_every_unit_reach_jsonl_and_tensorboard(tmp_path: Path) -> None:
    sizes = {"small": 5, "large": 10}
    trainer = make_trainer(
        tmp_path,
        units=lambda model: [ToyEvalUnit(model, display_name=name) for name in sizes],
        valid_data_readers=[
            make_valid_reader(Gangs.single().dp, size=size) for size in sizes.values()
        ],
        validate_every_n_steps=3,
        max_num_steps=5,
    )
    assert trainer.run() == 0
    model = trainer._unit.model

    for name, size in sizes.items():
        records = read_jsonl(tmp_path / "metrics" / "valid" / f"{name}.jsonl")
        assert [r["step_nr"] for r in records] == [3, 5]
        dataset = ToyDataset(size)
        with torch.no_grad():
            errors = (model(dataset.x) - dataset.y).pow(2) * dataset.mask
        # The final validation saw the final model and every example exactly once.
        assert records[-1]["num_targets"] == int(dataset.mask.sum())
        assert records[-1]["mse"] == pytest.approx((errors.sum() / dataset.mask.sum()).item())

        scalars = read_scalars(tmp_path / "tb" / "valid" / name)
        assert set(scalars) == {"mse", "num_targets"}
        for tag in ("mse", "num_targets"):
            assert [step for step, _ in scalars[tag]] == [3, 5]
            assert [value for _, value in scalars[tag]] == pytest.approx(
                [r[tag] for r in records], rel=1e-6
            )
    assert not (tmp_path / "metrics" / "valid.jsonl").exists()


def test_an_unnamed_unit_publishes_as_valid(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, validate_every_n_steps=6)
    assert trainer.run() == 0
    assert valid_steps(tmp_path) == [6]
    assert set(read_scalars(tmp_path / "tb" / "valid")) == {"mse", "num_targets"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"validate_every_n_steps": 2, "valid_data_readers": []},
            "valid_units and valid_data_readers must have the same length, but have 1 and 0",
        ),
        ({}, "validate_every_n_steps or validate_every_n_data_epochs must be set too"),
        (
            {"validate_every_n_steps": 2, "validate_after_n_steps": -1},
            "validate_after_n_steps must be zero or more, but is -1 instead",
        ),
        (
            {"validate_every_n_steps": 2, "early_stopper": lambda step_nr, score: False},
            "score_metric_name must be set too",
        ),
        (
            {
                "validate_every_n_steps": 2,
                "score_metric_name": "mse",
                "lower_better": True,
                "early_stopper": PatienceEarlyStopper(2, lower_better=False),
            },
            "early_stopper ranks scores with lower_better=False, but the Trainer has "
            "lower_better=True",
        ),
        (
            {
                "units": lambda model: [ToyEvalUnit(model, "a"), ToyEvalUnit(model, "a")],
                "validate_every_n_steps": 2,
            },
            "Each eval unit publishes its values under its display_name, so the names must "
            "differ, but more than one unit has the display_name 'a'.",
        ),
    ],
    ids=[
        "length_mismatch",
        "no_schedule",
        "negative_after",
        "stopper_without_score",
        "orientation",
        "same_display_name",
    ],
)
def test_bad_validation_arguments_are_clear_errors(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=_escape(message)):
        make_trainer(tmp_path, **kwargs)


def _escape(text: str) -> str:
    return text.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")


# -------------------------------------------------------------------------------- score


class ScoreRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.scores: dict[int, float | None] = {}

    def on_validation_end(
        self, *, step_nr: int, score: float | None, results: Mapping[str, Mapping[str, Any]]
    ) -> None:
        self.scores[step_nr] = score


def test_several_units_combine_into_the_mean_score(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = {2: 1.0, 4: 4.0, 6: 2.0}
    second = {2: 3.0, 4: 0.0, 6: 3.0}
    recorder = ScoreRecorder()
    trainer = make_trainer(
        tmp_path,
        units=lambda model: [
            ScriptedEvalUnit(model, first, display_name="a"),
            ScriptedEvalUnit(model, second, display_name="b"),
        ],
        validate_every_n_steps=2,
        checkpoint_every_n_steps=2,
        score_metric_name="score",
        lower_better=True,
        callbacks=[recorder],
    )
    with caplog.at_level(logging.INFO, logger="runtime"):
        assert trainer.run() == 0
    assert recorder.scores == {2: 2.0, 4: 2.0, 6: 2.5}
    assert [manifest(tmp_path, s)["score"] for s in (2, 4, 6)] == [2.0, 2.0, 2.5]
    # A tie is no improvement: the best stays the first to reach it.
    assert "Validation score at step 6: 2.5 (best: 2 at step 2)." in caplog.text


@pytest.mark.parametrize(("lower_better", "best_step"), [(True, 4), (False, 6)])
def test_lower_better_orients_the_best_score(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, lower_better: bool, best_step: int
) -> None:
    scores = {2: 5.0, 4: 1.0, 6: 7.0, 8: 3.0}
    trainer = make_trainer(
        tmp_path,
        units=scripted(scores),
        validate_every_n_steps=2,
        max_num_steps=8,
        score_metric_name="score",
        lower_better=lower_better,
    )
    with caplog.at_level(logging.INFO, logger="runtime"):
        assert trainer.run() == 0
    assert f"Validation score at step 8: 3 (best: {scores[best_step]:g} at step {best_step})." in (
        caplog.text
    )


def test_a_missing_score_metric_is_a_clear_error(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, validate_every_n_steps=2, score_metric_name="nll_loss")
    with pytest.raises(ValueError, match=r"score_metric_name is 'nll_loss', but the unit of run "):
        trainer.run()


def test_the_validation_at_start_is_a_baseline_not_a_best(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[int, float]] = []

    def stopper(step_nr: int, score: float) -> bool:
        calls.append((step_nr, score))
        return True  # would stop at once, if asked at step 0

    trainer = make_trainer(
        tmp_path,
        units=scripted({0: 0.0, 3: 2.0, 6: 1.0}),
        validate_every_n_steps=3,
        validate_at_start=True,
        score_metric_name="score",
        lower_better=True,
        early_stopper=stopper,
    )
    with caplog.at_level(logging.INFO, logger="runtime"):
        assert trainer.run() == 0
    assert valid_steps(tmp_path) == [0, 3]
    assert calls == [(3, 2.0)]
    assert "Validation score at step 3: 2 (best: 2 at step 3)." in caplog.text


def test_best_score_survives_a_resume(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    scores = {2: 3.0, 4: 1.0, 6: 2.0, 8: 4.0}
    kwargs: dict[str, Any] = {
        "units": scripted(scores),
        "validate_every_n_steps": 2,
        "checkpoint_every_n_steps": 2,
        "max_num_steps": 8,
        "score_metric_name": "score",
        "lower_better": True,
    }
    with pytest.raises(SimulatedCrash):
        make_trainer(tmp_path, callbacks=[CrashAt(4)], **kwargs).run()
    with caplog.at_level(logging.INFO, logger="runtime"):
        assert make_trainer(tmp_path, **kwargs).run() == 0
    assert "Resumed from the checkpoint of step 4." in caplog.text
    assert "Validation score at step 8: 4 (best: 1 at step 4)." in caplog.text
    assert "The best validation score was 1, at step 4." in caplog.text


# ------------------------------------------------------------------- keep-best retention


@pytest.mark.parametrize(
    "kwargs",
    [
        {"checkpoint_every_n_steps": 3, "validate_every_n_steps": 2},
        {"checkpoint_every_n_steps": 4, "validate_every_n_steps": 2, "validate_after_n_steps": 4},
        {"checkpoint_every_n_steps": 2, "validate_every_n_data_epochs": 1},
        {"checkpoint_every_n_data_epochs": 1, "validate_every_n_steps": 2},
        {"checkpoint_every_n_data_epochs": 3, "validate_every_n_data_epochs": 2},
    ],
    ids=[
        "not_a_multiple",
        "checkpoint_before_validation",
        "steps_vs_epochs",
        "epochs_vs_steps",
        "epochs",
    ],
)
def test_keep_best_with_unscored_checkpoints_is_a_clear_error(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="With keep-best retention every checkpoint needs a score"):
        make_trainer(tmp_path, keep_best_n_checkpoints=1, score_metric_name="mse", **kwargs)


def test_keep_best_accepts_a_schedule_where_every_checkpoint_is_scored(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path,
        keep_best_n_checkpoints=1,
        score_metric_name="mse",
        checkpoint_every_n_steps=4,
        checkpoint_after_n_steps=2,
        validate_every_n_steps=2,
        validate_after_n_steps=1,
        max_num_steps=8,
    )
    assert trainer.run() == 0
    infos = CheckpointManager(tmp_path / "checkpoints", Gangs.single()).list_checkpoints()
    assert all(info.score is not None for info in infos)


SCORES = {2: 5.0, 4: 1.0, 6: 6.0, 8: 2.0, 10: 7.0, 12: 3.0, 14: 4.0, 16: 8.0}


@pytest.mark.parametrize(
    ("lower_better", "expected"),
    [
        # best 2 (low): steps 4 and 8; last 2: 14 and 16.
        (True, [4, 8, 14, 16]),
        # best 2 (high): steps 16 and 10; last 2: 14 and 16.
        (False, [10, 14, 16]),
    ],
    ids=["lower_better", "higher_better"],
)
def test_keep_best_and_keep_last_through_the_trainer(
    tmp_path: Path, lower_better: bool, expected: list[int]
) -> None:
    trainer = make_trainer(
        tmp_path,
        units=scripted(SCORES),
        validate_every_n_steps=2,
        checkpoint_every_n_steps=2,
        max_num_steps=16,
        keep_best_n_checkpoints=2,
        keep_last_n_checkpoints=2,
        score_metric_name="score",
        lower_better=lower_better,
    )
    assert trainer.run() == 0
    assert checkpoint_steps(tmp_path) == expected
    for step_nr in expected:
        assert manifest(tmp_path, step_nr)["score"] == SCORES[step_nr]


def test_the_newest_checkpoint_survives_keep_best(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path,
        units=scripted({2: 1.0, 4: 2.0, 5: 3.0}),
        validate_every_n_steps=2,
        checkpoint_every_n_steps=2,
        max_num_steps=5,
        keep_best_n_checkpoints=1,
        score_metric_name="score",
        lower_better=True,
    )
    assert trainer.run() == 0
    # Step 5 is the end of training: validated and checkpointed there, and kept as the newest.
    assert checkpoint_steps(tmp_path) == [2, 5]
    assert manifest(tmp_path, 5)["score"] == 3.0


# ----------------------------------------------------------------------- early stopping


def test_early_stop_saves_a_final_checkpoint_and_exits_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Patience 2: best at step 4, no improvement at 6 and 8, stop at 8 (of 20).
    scores = {2: 3.0, 4: 1.0, 6: 1.5, 8: 1.2}
    kwargs: dict[str, Any] = {
        "units": scripted(scores),
        "validate_every_n_steps": 2,
        "checkpoint_every_n_steps": 6,
        "publish_metrics_every_n_steps": 3,
        "max_num_steps": 20,
        "score_metric_name": "score",
        "lower_better": True,
    }
    trainer = make_trainer(tmp_path, early_stopper=PatienceEarlyStopper(2), **kwargs)
    with caplog.at_level(logging.INFO):
        assert trainer.run() == 0
    assert trainer.step_nr == 8
    assert "The early stopper stopped the training at step 8." in caplog.text
    assert checkpoint_steps(tmp_path) == [6, 8]
    assert manifest(tmp_path, 8)["score"] == pytest.approx(1.2)
    assert valid_steps(tmp_path) == [2, 4, 6, 8]
    # The train metrics of steps 7 and 8 are published before the exit.
    assert valid_steps(tmp_path, "train") == [3, 6, 8]

    caplog.clear()
    again = make_trainer(tmp_path, early_stopper=PatienceEarlyStopper(2), **kwargs)
    with caplog.at_level(logging.INFO):
        assert again.run() == 0
    assert "The run finished at step 8 already; nothing to do." in caplog.text
    assert again.step_nr == 8
    assert checkpoint_steps(tmp_path) == [6, 8]
    assert valid_steps(tmp_path) == [2, 4, 6, 8]


def test_early_stop_at_a_data_epoch_end_is_final(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs: dict[str, Any] = {
        "units": scripted({8: 1.0, 16: 2.0, 24: 3.0}),
        "validate_every_n_data_epochs": 1,
        "checkpoint_every_n_data_epochs": 1,
        "max_num_steps": None,
        "max_num_data_epochs": 5,
        "score_metric_name": "score",
        "lower_better": True,
    }
    trainer = make_trainer(tmp_path, early_stopper=PatienceEarlyStopper(1), **kwargs)
    assert trainer.run() == 0
    assert trainer.step_nr == 16
    assert checkpoint_steps(tmp_path) == [8, 16]

    again = make_trainer(tmp_path, early_stopper=PatienceEarlyStopper(1), **kwargs)
    with caplog.at_level(logging.INFO):
        assert again.run() == 0
    assert "The run finished at step 16 already; nothing to do." in caplog.text


def test_a_run_that_ended_with_its_last_data_epoch_is_final(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs: dict[str, Any] = {
        "validate_every_n_data_epochs": 1,
        "checkpoint_every_n_data_epochs": 1,
        "publish_metrics_every_n_steps": 5,
        "max_num_steps": None,
        "max_num_data_epochs": 2,
    }
    assert make_trainer(tmp_path, **kwargs).run() == 0
    assert checkpoint_steps(tmp_path) == [8, 16]
    assert valid_steps(tmp_path) == [8, 16]
    assert valid_steps(tmp_path, "train") == [5, 10, 15, 16]

    with caplog.at_level(logging.INFO, logger="runtime"):
        assert make_trainer(tmp_path, **kwargs).run() == 0
    assert "The run finished at step 16 already; nothing to do." in caplog.text
    # Nothing published twice.
    assert valid_steps(tmp_path) == [8, 16]
    assert valid_steps(tmp_path, "train") == [5, 10, 15, 16]


def test_patience_state_survives_a_resume(tmp_path: Path) -> None:
    # Best at step 2; no improvement at 4, 6, 8: patience 3 runs out at step 8.
    scores = {2: 1.0, 4: 2.0, 6: 3.0, 8: 1.5, 10: 0.5}
    kwargs: dict[str, Any] = {
        "units": scripted(scores),
        "validate_every_n_steps": 2,
        "checkpoint_every_n_steps": 2,
        "max_num_steps": 10,
        "score_metric_name": "score",
        "lower_better": True,
    }
    with pytest.raises(SimulatedCrash):
        make_trainer(
            tmp_path, early_stopper=PatienceEarlyStopper(3), callbacks=[CrashAt(6)], **kwargs
        ).run()
    # A fresh stopper would count from step 6 on and stop no earlier than step 10.
    stopper = PatienceEarlyStopper(3)
    trainer = make_trainer(tmp_path, early_stopper=stopper, **kwargs)
    assert trainer.run() == 0
    assert trainer.step_nr == 8
    assert stopper.state_dict() == {"best": 1.0, "num_bad": 3}


def test_patience_early_stopper_counts_validations_without_improvement() -> None:
    stopper = PatienceEarlyStopper(2, min_delta=0.1, lower_better=True)
    # 0.95 improves by less than min_delta: it counts as no improvement.
    assert [stopper(step, score) for step, score in enumerate([1.0, 0.95, 0.5, 0.6, 0.7])] == [
        False,
        False,
        False,
        False,
        True,
    ]
    higher = PatienceEarlyStopper(1, lower_better=False)
    assert [higher(step, score) for step, score in enumerate([1.0, 2.0, 1.5])] == [
        False,
        False,
        True,
    ]


def test_patience_early_stopper_never_counts_a_nan_as_the_best() -> None:
    stopper = PatienceEarlyStopper(2)
    nan = float("nan")
    assert [stopper(step, score) for step, score in enumerate([nan, 1.0, nan, 2.0])] == [
        False,
        False,
        False,
        True,
    ]
    assert stopper.state_dict() == {"best": 1.0, "num_bad": 2}


def test_a_nan_score_is_never_the_best(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = make_trainer(
        tmp_path,
        units=scripted({2: float("nan"), 4: 3.0, 6: 2.0, 8: 4.0}),
        validate_every_n_steps=2,
        checkpoint_every_n_steps=2,
        max_num_steps=8,
        keep_best_n_checkpoints=1,
        score_metric_name="score",
        lower_better=True,
    )
    with caplog.at_level(logging.INFO, logger="runtime"):
        assert trainer.run() == 0
    assert "The validation score at step 2 is nan: it never counts as the best." in caplog.text
    assert "Validation score at step 8: 4 (best: 2 at step 6)." in caplog.text
    assert checkpoint_steps(tmp_path) == [6, 8]
    assert read_jsonl(tmp_path / "metrics" / "valid.jsonl")[0] == {"step_nr": 2, "score": None}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"patience": 0}, "patience must be greater than zero, but is 0 instead."),
        (
            {"patience": 1, "min_delta": -0.5},
            "min_delta must be zero or more, but is -0.5 instead.",
        ),
    ],
)
def test_patience_early_stopper_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=_escape(message)):
        PatienceEarlyStopper(**kwargs)


def test_early_stop_is_agreed_by_both_ranks(tmp_path: Path, run_torchrun: RunTorch) -> None:
    # min_delta so large that nothing counts as an improvement: patience 2 runs out at the third
    # validation (step 6 of 20), whatever the losses.
    result = run_torchrun(
        2,
        "-m",
        "tests.workers.valid_toy",
        str(tmp_path),
        "--config",
        "max_num_steps=20",
        "checkpoint_every_n_steps=4",
        "early_stop_patience=2",
        "early_stop_min_delta=1000.0",
    )
    assert_ok(result)
    for rank in (0, 1):
        text = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        assert "The early stopper stopped the training at step 6." in text, text
        assert "Training finished at step 6." in text
    # Only rank 0 asks the stopper (it logs each validation without an improvement).
    no_improvement = "No improvement over the best score"
    assert no_improvement in (tmp_path / "logs" / "rank_0.log").read_text()
    assert no_improvement not in (tmp_path / "logs" / "rank_1.log").read_text()
    assert [r["step_nr"] for r in read_jsonl(tmp_path / "metrics" / "valid.jsonl")] == [2, 4, 6]
    assert checkpoint_steps(tmp_path) == [4, 6]
    assert manifest(tmp_path, 6)["world_size"] == 2


def test_a_failing_early_stopper_fails_every_rank(tmp_path: Path, run_torchrun: RunTorch) -> None:
    result = run_torchrun(
        2,
        "-m",
        "tests.workers.valid_toy",
        str(tmp_path),
        "--config",
        "stopper_fails_at_step=4",
        timeout=120,
    )
    assert result.returncode != 0
    # Rank 1 learns why from rank 0 instead of waiting for a decision that never comes.
    rank_0 = (tmp_path / "logs" / "rank_0.log").read_text()
    rank_1 = (tmp_path / "logs" / "rank_1.log").read_text()
    assert "RuntimeError: the stopper broke at step 4" in rank_0
    assert (
        "TrainerError: The early stopper failed on rank 0 at step 4: RuntimeError: the stopper "
        "broke at step 4" in rank_1
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "num_ranks",
    # make test: 3 ranks; test_uneven_validation scores every size on 2 against one process.
    [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3],
)
def test_the_score_is_the_mean_over_the_whole_valid_set_at_any_dp_size(
    tmp_path: Path, num_ranks: int
) -> None:
    from tests.runtime.training import valid_score_worker as worker

    result = torchrun(num_ranks, str(Path(worker.__file__)), str(tmp_path), timeout=300)
    assert_ok(result)
    data = worker.dataset()
    x, y = data.datasets["x"], data.datasets["y"]  # type: ignore[index]
    with torch.no_grad():
        expected = (worker.model()(x) - y).square().mean().item()
    first = read_jsonl(tmp_path / "metrics" / "valid.jsonl")[0]
    assert first["step_nr"] == 0
    assert first["squared_error"] == pytest.approx(expected, rel=1e-6)


# ------------------------------------------- validation and evaluation before training, sharded

HF_WORKER = "tests/workers/hf_validation.py"


def run_hf_worker(out: Path, nproc: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each of ``runs`` in one launch: its name to rank 0's ``result.json``."""
    assert_ok(torchrun(nproc, HF_WORKER, str(out), json.dumps({"runs": runs})))
    return {name: json.loads((out / name / "result.json").read_text()) for name in runs}


@pytest.fixture(scope="module")
def fsdp2_llama_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The FSDP2 runs of the tests below, in one launch of two processes."""
    return run_hf_worker(
        tmp_path_factory.mktemp("hf_validation"),
        2,
        {
            "validate": {"first": "validate", "data_parallel": "fsdp"},
            "evaluate": {"first": "evaluate", "data_parallel": "fsdp"},
        },
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "options"),
    [
        pytest.param(2, {"data_parallel": "fsdp"}, id="fsdp2"),
        pytest.param(
            4, {"data_parallel": "hsdp", "dp_shard_size": 2}, id="hsdp2x2", marks=pytest.mark.slow
        ),
    ],
)
def test_a_sharded_llama_trains_after_validate_at_start(
    request: pytest.FixtureRequest, tmp_path: Path, nproc: int, options: dict[str, Any]
) -> None:
    # A transformers Llama built on meta, sharded over its decoder layers: the validation
    # before the first step must leave the sharded parameters' buffers trainable.
    if nproc == 2:
        result = request.getfixturevalue("fsdp2_llama_runs")["validate"]
    else:
        result = run_hf_worker(tmp_path, nproc, {"validate": {"first": "validate", **options}})
        result = result["validate"]
    assert result["steps"] == [1, 2]
    assert result["evaluated"] == [["valid", 0], ["valid", 2]]
    assert all(math.isfinite(norm) and norm > 0 for norm in result["grad_norms"])


@pytest.mark.distributed
def test_a_sharded_llama_trains_after_an_evaluation_in_the_same_process(
    fsdp2_llama_runs: dict[str, Any],
) -> None:
    result = fsdp2_llama_runs["evaluate"]
    assert result["evaluated"] == [["eval", 0]]
    assert result["steps"] == [1, 2]
    assert all(math.isfinite(norm) and norm > 0 for norm in result["grad_norms"])


def test_max_num_valid_steps_caps_the_batches_of_every_validation(tmp_path: Path) -> None:
    # 10 examples in batches of 4: three batches uncapped; capped at one, every validation sees
    # exactly the first batch (the reader starts over after each).
    capped = make_trainer(tmp_path / "capped", max_num_valid_steps=1, validate_every_n_steps=2)
    capped.run()
    full = make_trainer(tmp_path / "full", validate_every_n_steps=2)
    full.run()
    dataset = ToyDataset(10)
    first_batch = collate([dataset[i] for i in range(4)])
    capped_records = read_jsonl(tmp_path / "capped" / "metrics" / "valid.jsonl")
    full_records = read_jsonl(tmp_path / "full" / "metrics" / "valid.jsonl")
    assert [r["step_nr"] for r in capped_records] == [2, 4, 6]
    assert [r["num_targets"] for r in capped_records] == [first_batch.num_targets] * 3
    assert full_records[0]["num_targets"] > first_batch.num_targets


def test_max_num_valid_steps_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_num_valid_steps must be greater than zero"):
        make_trainer(tmp_path, max_num_valid_steps=0, validate_every_n_steps=2)


def test_a_validation_schedule_without_valid_units_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no valid_units are given"):
        make_toy_trainer(tmp_path, validate_every_n_steps=2)


def test_the_trainer_moves_every_unit_metric_to_its_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torcheval keeps a metric on the CPU unless told otherwise, where a unit's update with a
    CUDA loss fails: the Trainer moves the train and valid units' metrics to the gangs' device.
    On the CPU no move shows, so every metric's to() is watched."""
    from torcheval.metrics import Metric

    moved_to: dict[int, torch.device] = {}
    original_to = Metric.to

    def watched_to(metric: Metric[Any], device: Any, *args: Any, **kwargs: Any) -> Any:
        moved_to[id(metric)] = torch.device(device)
        return original_to(metric, device, *args, **kwargs)

    monkeypatch.setattr(Metric, "to", watched_to)
    model = ToyModel()
    unit = ToyUnit(model, mean_loss=False, zero_targets=False)
    valid_units = [ToyEvalUnit(model, "a"), ToyEvalUnit(model, "b")]
    assert not moved_to
    trainer = make_trainer(
        tmp_path, unit=unit, units=lambda _: valid_units, validate_every_n_steps=3
    )
    device = trainer.gangs.root.device
    for bag in [unit.metric_bag, *(u.metric_bag for u in valid_units)]:
        for name, metric in bag.metrics.items():
            assert moved_to.get(id(metric)) == device, name
