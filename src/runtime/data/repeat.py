"""A reader that serves each step's batches several times in a row: GRPO's ``num_iterations``,
which takes that many optimizer steps on one batch of prompts (TRL's ``RepeatSampler`` with
``repeat_count``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from runtime.data.data_reader import DataReader, DataReaderWrapper
from trainkit_utils.arguments import check_positive

BatchT = TypeVar("BatchT")


class RepeatingDataReader(DataReaderWrapper[BatchT]):
    """Each of ``reader``'s steps ``times`` times in a row. A checkpoint holds ``reader``'s state
    before the step being repeated and how often it was served, so a resume in the middle
    serves the same batches the remaining times."""

    def __init__(self, reader: DataReader[BatchT], times: int) -> None:
        check_positive("times", times)
        super().__init__(reader)
        self._times = times
        self._current: list[BatchT] | None = None
        self._served = 0
        self._served_on_resume = 0
        self._state_before: dict[str, object] | None = None

    def __next__(self) -> list[BatchT]:
        if self._current is None or self._served == self._times:
            self._state_before = self._reader.state_dict()
            self._current = next(self._reader)
            self._served, self._served_on_resume = self._served_on_resume, 0
        self._served += 1
        return self._current

    def reset(self) -> None:
        self._reader.reset()
        self._current, self._served = None, 0

    def state_dict(self) -> dict[str, object]:
        if self._current is None or self._served == self._times:
            return {"reader": self._reader.state_dict(), "served": 0}
        return {"reader": self._state_before, "served": self._served}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reader.load_state_dict(state["reader"])
        self._current, self._served = None, 0
        self._served_on_resume = int(state["served"])
