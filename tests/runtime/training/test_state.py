"""The stop reason, and the trainer state a checkpoint holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointError
from runtime import StopReason, TrainState
from runtime.training.state import TRAINER_STATE_SECTIONS, check_trainer_state


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


def test_a_trainer_state_of_another_format_is_a_clear_error() -> None:
    with pytest.raises(CheckpointError, match="format version 2, but this version of the runtime"):
        check_trainer_state({"version": 2})
    with pytest.raises(CheckpointError, match="format version None"):
        check_trainer_state({"step_nr": 3})
    state = {section: {} for section in TRAINER_STATE_SECTIONS} | {"version": 3}
    assert check_trainer_state(state) is state
    with pytest.raises(CheckpointError, match="has unknown entries surprise"):
        check_trainer_state({**state, "surprise": 1})


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
