"""When recurring work is due: publishing metrics, validating, checkpointing, collecting garbage.

What falls due after a step is host arithmetic on its number (:meth:`Schedules.due_after_step`),
so deciding it never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from trainkit_utils.arguments import check_not_negative, check_positive


@final
@dataclass(frozen=True)
class Schedule:
    """Due after every ``every_n_steps``-th step past ``after_n_steps``, and at the end of every
    ``every_n_data_epochs``-th data epoch. ``None`` turns a trigger off.

    ``name`` is the prefix of the Trainer arguments it comes from (``validate`` for
    ``validate_every_n_steps``), so errors name the argument the user gave.
    """

    name: str
    every_n_steps: int | None = None
    after_n_steps: int = 0
    every_n_data_epochs: int | None = None

    def __post_init__(self) -> None:
        check_positive(f"{self.name}_every_n_steps", self.every_n_steps)
        check_not_negative(f"{self.name}_after_n_steps", self.after_n_steps)
        check_positive(f"{self.name}_every_n_data_epochs", self.every_n_data_epochs)

    @property
    def is_set(self) -> bool:
        return self.every_n_steps is not None or self.every_n_data_epochs is not None

    def due_after_step(self, step_nr: int) -> bool:
        every = self.every_n_steps
        return every is not None and step_nr > self.after_n_steps and step_nr % every == 0

    def due_after_data_epoch(self, data_epoch_nr: int) -> bool:
        every = self.every_n_data_epochs
        return every is not None and data_epoch_nr % every == 0

    def steps_covered_by(self, other: Schedule) -> bool:
        """Whether ``other`` is due after every step this schedule is due after."""
        return self.every_n_steps is None or (
            other.every_n_steps is not None
            and self.every_n_steps % other.every_n_steps == 0
            and self.after_n_steps >= other.after_n_steps
        )

    def data_epochs_covered_by(self, other: Schedule) -> bool:
        """Whether ``other`` is due at the end of every data epoch this schedule is due at."""
        return self.every_n_data_epochs is None or (
            other.every_n_data_epochs is not None
            and self.every_n_data_epochs % other.every_n_data_epochs == 0
        )


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class Due:
    """What falls due after one step."""

    publish: bool
    validate: bool
    checkpoint: bool
    collect_garbage: bool


@final
@dataclass(frozen=True, kw_only=True)
class Schedules:
    """The schedules of the recurring work of a run; the one place that says what is due when."""

    publish: Schedule = Schedule("publish_metrics")
    validate: Schedule = Schedule("validate")
    checkpoint: Schedule = Schedule("checkpoint")
    collect_garbage: Schedule = Schedule("gc")
    validate_at_start: bool = False

    def due_after_step(self, step_nr: int) -> Due:
        return Due(
            publish=self.publish.due_after_step(step_nr),
            validate=self.validate.due_after_step(step_nr),
            checkpoint=self.checkpoint.due_after_step(step_nr),
            collect_garbage=self.collect_garbage.due_after_step(step_nr),
        )


def check_every_checkpoint_is_scored(checkpoint: Schedule, validate: Schedule) -> None:
    """Keep-best ranks checkpoints by score, so each scheduled one must follow a validation."""
    if not checkpoint.steps_covered_by(validate):
        raise ValueError(
            "With keep-best retention every checkpoint needs a score, so "
            f"checkpoint_every_n_steps ({checkpoint.every_n_steps}) must be a multiple of "
            f"validate_every_n_steps ({validate.every_n_steps}), and checkpoint_after_n_steps "
            f"({checkpoint.after_n_steps}) at least validate_after_n_steps "
            f"({validate.after_n_steps})."
        )
    if not checkpoint.data_epochs_covered_by(validate):
        raise ValueError(
            "With keep-best retention every checkpoint needs a score, so "
            f"checkpoint_every_n_data_epochs ({checkpoint.every_n_data_epochs}) must be a "
            f"multiple of validate_every_n_data_epochs ({validate.every_n_data_epochs})."
        )


def check_snapshots_are_saved(checkpoint: Schedule, keep_every_n_steps: int | None) -> None:
    """Permanent snapshots fall on steps that are multiples of ``keep_every_n_steps``, so
    checkpoints must be saved there."""
    every = checkpoint.every_n_steps
    if keep_every_n_steps is not None and (every is None or keep_every_n_steps % every != 0):
        raise ValueError(
            f"keep_checkpoint_every_n_steps ({keep_every_n_steps}) keeps the checkpoints of its "
            f"multiples, so it must be a multiple of checkpoint_every_n_steps ({every}) for "
            "checkpoints to be saved there. Set checkpoint_every_n_steps to a divisor of it."
        )
