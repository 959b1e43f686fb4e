"""The stop reason, the trainer state a checkpoint holds, and checkpoints of the first format."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointError, CheckpointManager
from gangs import Gangs
from runtime import MapDataReader, StopReason, Trainer, TrainState
from runtime.training.state import TRAINER_STATE_SECTIONS, upgrade_trainer_state
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate

FORMAT_1_RUN = Path(__file__).resolve().parents[3] / "tests" / "data" / "format_1_run"


def test_only_a_preemption_leaves_the_run_unfinished() -> None:
    assert [reason for reason in StopReason if not reason.ends_the_run] == [StopReason.PREEMPTED]
    assert {reason for reason in StopReason if reason.is_limit} == {
        StopReason.MAX_NUM_STEPS,
        StopReason.MAX_NUM_DATA_EPOCHS,
    }


def test_state_round_trip_and_a_preemption_saved_as_not_stopped() -> None:
    state = TrainState()
    state.step_nr, state.data_epoch_nr, state.stop_reason = 12, 3, StopReason.EARLY_STOP
    restored = TrainState()
    restored.load_state_dict(state.state_dict())
    assert (restored.step_nr, restored.data_epoch_nr, restored.stop_reason) == (
        12,
        3,
        StopReason.EARLY_STOP,
    )
    assert restored.finished

    state.stop_reason = StopReason.PREEMPTED
    assert state.state_dict()["stop_reason"] is None
    restored.load_state_dict(state.state_dict())
    assert restored.stop_reason is None and not restored.finished


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"step_nr": 1, "data_epoch_nr": 1}, "lacks stop_reason"),
        (
            {"step_nr": 1, "data_epoch_nr": 1, "stop_reason": None, "finished": True},
            "has unknown entries finished",
        ),
        ({"step_nr": 1, "data_epoch_nr": 1, "stop_reason": "tired"}, "stop reason 'tired'"),
    ],
)
def test_a_state_that_does_not_fit_is_a_clear_error(state: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        TrainState().load_state_dict(state)


def format_1_state(**flags: bool) -> dict[str, Any]:
    """A trainer state as format 1 wrote it (flat, three booleans for the stop reason)."""
    state: dict[str, Any] = {
        "step_nr": 7,
        "data_epoch_nr": 2,
        "finished": False,
        "early_stopped": False,
        "data_exhausted": False,
        "data_reader": {"epoch": 1},
        "rng": {"torch": torch.get_rng_state()},
        "loss_scaler": {"scale": 128.0, "good_steps": 3},
        "train_metrics": {"toy_loss": {}},
        "window": {
            "loss_sum": torch.tensor(1.5, dtype=torch.float64),
            "grad_norm_sum": torch.tensor(0.5),
            "local_weight": 4,
            "total_weight": 8.0,
            "total_examples": 2.0,
            "num_steps": 1,
        },
        "last_score": 0.5,
        "best_score": 0.25,
        "best_step_nr": 4,
        "last_validated_step": 6,
    }
    state.update(flags)
    return state


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        ({}, None),
        ({"finished": True}, "max_num_steps"),
        ({"finished": True, "data_exhausted": True}, "max_num_data_epochs"),
        ({"finished": True, "early_stopped": True}, "early_stop"),
        # The final validation after the last data epoch may stop early too: that is final.
        ({"finished": True, "early_stopped": True, "data_exhausted": True}, "early_stop"),
    ],
)
def test_format_1_maps_its_booleans_onto_one_stop_reason(
    flags: dict[str, bool], reason: str | None
) -> None:
    upgraded = upgrade_trainer_state(format_1_state(**flags))
    assert set(upgraded) == TRAINER_STATE_SECTIONS
    assert upgraded["train_state"] == {"step_nr": 7, "data_epoch_nr": 2, "stop_reason": reason}
    assert upgraded["train_step"] == {
        "loss_scaler": {"scale": 128.0, "good_steps": 3},
        "lr_scheduler": None,
    }
    assert upgraded["train_metrics"]["window"]["num_local_targets"] == 4
    assert upgraded["train_metrics"]["window"]["num_targets"] == 8.0
    # Formats 1 and 2 measured the gradient norm of every step.
    assert upgraded["train_metrics"]["window"]["num_grad_norms"] == 1
    assert upgraded["validation"]["best_step_nr"] == 4
    assert upgraded["validation"]["early_stopper"] is None


def test_a_format_2_window_counts_a_gradient_norm_for_each_of_its_steps(tmp_path: Path) -> None:
    trainer, _ = format_1_trainer(tmp_path, max_num_steps=3)
    trainer.run()
    state = torch.load(tmp_path / "checkpoints/step_3/trainer/rank_0.pt", weights_only=True)
    assert state["version"] == 3
    window = state["train_metrics"]["window"]
    assert window["num_steps"] == 1 and window["num_grad_norms"] == 1  # clipping measures each
    del window["num_grad_norms"]
    upgraded = upgrade_trainer_state({**state, "version": 2})
    assert upgraded["version"] == 3
    assert upgraded["train_metrics"]["window"] == {**window, "num_grad_norms": 1}


def test_unknown_formats_and_entries_are_clear_errors() -> None:
    with pytest.raises(CheckpointError, match="format version 4, but this version"):
        upgrade_trainer_state({"version": 4})
    with pytest.raises(CheckpointError, match="has unknown entries surprise"):
        upgrade_trainer_state({**format_1_state(), "surprise": 1})
    with pytest.raises(CheckpointError, match="lacks window"):
        upgrade_trainer_state({k: v for k, v in format_1_state().items() if k != "window"})


def format_1_trainer(output_dir: Path, max_num_steps: int) -> tuple[Trainer[ToyBatch], ToyModel]:
    """The Trainer of the run in tests/data/format_1_run (see its README)."""
    gangs = Gangs.single()
    torch.manual_seed(0)
    model = ToyModel()
    reader = MapDataReader(
        dataset=ToyDataset(32), batch_size=4, collate=collate, gang=gangs.dp, seed=3
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=reader,
        optimizer=optimizer,
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        lr_scheduler=scheduler,
        max_num_steps=max_num_steps,
        checkpoint_every_n_steps=3,
        publish_metrics_every_n_steps=2,
        max_gradient_norm=0.5,
        progress=False,
    )
    return trainer, model


def assert_params_equal(model: ToyModel, expected_file: Path) -> None:
    expected = torch.load(expected_file, weights_only=True)
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def test_todays_code_trains_exactly_as_format_1_did(tmp_path: Path) -> None:
    trainer, model = format_1_trainer(tmp_path, max_num_steps=9)
    assert trainer.run() == 0
    assert_params_equal(model, FORMAT_1_RUN / "params_step_9.pt")
    state = torch.load(tmp_path / "checkpoints/step_9/trainer/rank_0.pt", weights_only=True)
    assert set(state) == TRAINER_STATE_SECTIONS and state["version"] == 3
    assert state["train_state"] == {
        "step_nr": 9,
        "data_epoch_nr": 2,
        "stop_reason": "max_num_steps",
    }


def test_a_finished_format_1_run_trains_on_bit_identically(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copytree(FORMAT_1_RUN / "checkpoints", tmp_path / "checkpoints")
    trainer, model = format_1_trainer(tmp_path, max_num_steps=6)
    assert trainer.run() == 0  # finished at step 6 already
    assert_params_equal(model, FORMAT_1_RUN / "params_step_6.pt")

    trainer, model = format_1_trainer(tmp_path, max_num_steps=9)
    with caplog.at_level(logging.INFO, logger="runtime.training.trainer"):
        assert trainer.run() == 0
    assert "The run finished at step 6, but max_num_steps (9)" in caplog.text
    assert_params_equal(model, FORMAT_1_RUN / "params_step_9.pt")


def test_a_format_1_checkpoint_from_mid_run_resumes_bit_identically(tmp_path: Path) -> None:
    shutil.copytree(FORMAT_1_RUN / "checkpoints" / "step_3", tmp_path / "checkpoints" / "step_3")
    trainer, model = format_1_trainer(tmp_path, max_num_steps=9)
    assert trainer.run() == 0
    assert trainer.step_nr == 9
    assert_params_equal(model, FORMAT_1_RUN / "params_step_9.pt")


def test_numpy_generator_is_seeded_per_rank_and_restored_from_a_checkpoint(
    tmp_path: Path,
) -> None:
    import numpy as np

    from runtime.training.rng import rng_state, seed_rngs, set_rng_state

    seed_rngs(3, dp_rank=0, dp_size=2)
    rank_0 = np.random.rand(3)
    seed_rngs(3, dp_rank=1, dp_size=2)
    assert not np.array_equal(np.random.rand(3), rank_0)
    seed_rngs(3, dp_rank=0, dp_size=2)
    assert np.array_equal(np.random.rand(3), rank_0)

    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = np.random.rand(3)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert np.array_equal(np.random.rand(3), expected)
