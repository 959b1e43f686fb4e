"""The Trainer's ``max_num_steps`` and ``max_num_data_epochs``: when they end the training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from runtime.training.state import StopReason, TrainState
from trainkit_utils.arguments import check_positive


@final
@dataclass(frozen=True)
class Limits:
    max_num_steps: int | None
    max_num_data_epochs: int | None

    def __post_init__(self) -> None:
        check_positive("max_num_steps", self.max_num_steps)
        check_positive("max_num_data_epochs", self.max_num_data_epochs)

    def reached(self, state: TrainState) -> bool:
        """Whether ``max_num_steps`` or ``max_num_data_epochs`` ends the training at ``state``."""
        if self.max_num_steps is not None and state.step_nr >= self.max_num_steps:
            return True
        return (
            state.stop_reason is StopReason.MAX_NUM_DATA_EPOCHS
            and self.max_num_data_epochs is not None
            and state.data_epoch_nr >= self.max_num_data_epochs
        )
