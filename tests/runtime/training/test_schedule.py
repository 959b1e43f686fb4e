"""Schedules: when publishing, validation and checkpoints fall due."""

from __future__ import annotations

import itertools

import pytest

from runtime import Schedule
from runtime.training.schedule import Due, Schedules, check_every_checkpoint_is_scored


def due_steps(schedule: Schedule, last: int = 20) -> list[int]:
    return [step for step in range(1, last + 1) if schedule.due_after_step(step)]


def test_every_n_steps_after_m() -> None:
    assert due_steps(Schedule("validate", every_n_steps=4)) == [4, 8, 12, 16, 20]
    assert due_steps(Schedule("validate", every_n_steps=4, after_n_steps=8)) == [12, 16, 20]
    # "After m" is strict: a step equal to m is not due.
    assert due_steps(Schedule("validate", every_n_steps=5, after_n_steps=5)) == [10, 15, 20]


def test_schedules_say_what_falls_due_after_each_step() -> None:
    schedules = Schedules(
        publish=Schedule("publish_metrics", every_n_steps=2),
        validate=Schedule("validate", every_n_steps=3, after_n_steps=3),
        checkpoint=Schedule("checkpoint", every_n_steps=6),
        collect_garbage=Schedule("gc", every_n_steps=4),
    )
    due = [schedules.due_after_step(step) for step in range(1, 13)]
    assert [step for step, d in enumerate(due, 1) if d.publish] == [2, 4, 6, 8, 10, 12]
    assert [step for step, d in enumerate(due, 1) if d.validate] == [6, 9, 12]
    assert [step for step, d in enumerate(due, 1) if d.checkpoint] == [6, 12]
    assert [step for step, d in enumerate(due, 1) if d.collect_garbage] == [4, 8, 12]
    assert schedules.due_after_step(5) == Due(
        publish=False, validate=False, checkpoint=False, collect_garbage=False
    )


def test_every_n_data_epochs() -> None:
    schedule = Schedule("checkpoint", every_n_data_epochs=3)
    assert [e for e in range(1, 10) if schedule.due_after_data_epoch(e)] == [3, 6, 9]
    assert due_steps(schedule) == []


def test_an_unset_schedule_is_never_due() -> None:
    schedule = Schedule("publish_metrics")
    assert not schedule.is_set
    assert due_steps(schedule) == []
    assert not any(schedule.due_after_data_epoch(e) for e in range(1, 10))
    assert Schedule("validate", every_n_data_epochs=1).is_set


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "validate_every_n_steps must be greater than zero, but is 0"),
        ({"after_n_steps": -1}, "validate_after_n_steps must be zero or more, but is -1"),
        ({"every_n_data_epochs": -2}, "validate_every_n_data_epochs must be greater than zero"),
    ],
)
def test_bad_values_name_the_trainer_argument(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule("validate", **kwargs)


def test_keep_best_needs_a_validation_at_every_checkpoint() -> None:
    validate = Schedule("validate", every_n_steps=2, after_n_steps=2, every_n_data_epochs=1)
    check_every_checkpoint_is_scored(
        Schedule("checkpoint", every_n_steps=4, after_n_steps=2), validate
    )
    check_every_checkpoint_is_scored(Schedule("checkpoint", every_n_data_epochs=2), validate)
    with pytest.raises(ValueError, match=r"checkpoint_every_n_steps \(3\) must be a multiple"):
        check_every_checkpoint_is_scored(Schedule("checkpoint", every_n_steps=3), validate)
    with pytest.raises(ValueError, match=r"checkpoint_after_n_steps \(0\) at least"):
        check_every_checkpoint_is_scored(Schedule("checkpoint", every_n_steps=4), validate)
    with pytest.raises(
        ValueError, match=r"checkpoint_every_n_data_epochs \(1\) must be a multiple"
    ):
        check_every_checkpoint_is_scored(
            Schedule("checkpoint", every_n_data_epochs=1),
            Schedule("validate", every_n_steps=2, every_n_data_epochs=2),
        )


def test_coverage_is_never_claimed_wrongly() -> None:
    # Whenever a checkpoint schedule counts as covered, every step and epoch it is due at
    # really has a validation.
    values = [None, 1, 2, 3, 4, 6]
    afters = [0, 1, 3, 4]
    for ck_every, ck_after, val_every, val_after in itertools.product(
        values, afters, values, afters
    ):
        checkpoint = Schedule("checkpoint", every_n_steps=ck_every, after_n_steps=ck_after)
        validate = Schedule("validate", every_n_steps=val_every, after_n_steps=val_after)
        if checkpoint.steps_covered_by(validate):
            assert set(due_steps(checkpoint, 48)) <= set(due_steps(validate, 48))
    for ck_every, val_every in itertools.product(values, values):
        checkpoint = Schedule("checkpoint", every_n_data_epochs=ck_every)
        validate = Schedule("validate", every_n_data_epochs=val_every)
        if checkpoint.data_epochs_covered_by(validate):
            epochs = range(1, 25)
            assert all(
                validate.due_after_data_epoch(e)
                for e in epochs
                if checkpoint.due_after_data_epoch(e)
            )
