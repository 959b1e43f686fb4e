"""The stop reason, and the trainer state a checkpoint holds."""

from __future__ import annotations

from typing import Any

import pytest

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
