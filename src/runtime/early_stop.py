"""Stopping the training when the validation score stops improving."""

from __future__ import annotations

import logging
from typing import Any, Protocol, final, runtime_checkable

log = logging.getLogger(__name__)


class EarlyStopper(Protocol):
    """Any callable ``(step_nr, score) -> bool``; ``True`` stops the training."""

    def __call__(self, step_nr: int, score: float) -> bool: ...


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@final
class PatienceEarlyStopper:
    """Stops after ``patience`` validations in a row without an improvement over ``min_delta``."""

    def __init__(self, patience: int, min_delta: float = 0.0, lower_better: bool = True) -> None:
        if patience <= 0:
            raise ValueError(f"patience must be greater than zero, but is {patience} instead.")
        if min_delta < 0:
            raise ValueError(f"min_delta must be zero or more, but is {min_delta} instead.")
        self._patience = patience
        self._min_delta = min_delta
        self._lower_better = lower_better
        self._best: float | None = None
        self._num_bad = 0

    def __call__(self, step_nr: int, score: float) -> bool:
        improvement = (
            None
            if self._best is None
            else (self._best - score if self._lower_better else score - self._best)
        )
        if improvement is None or improvement > self._min_delta:
            self._best = score
            self._num_bad = 0
            return False
        self._num_bad += 1
        log.info(
            "No improvement over the best score %g at step %d (%d of %d).",
            self._best,
            step_nr,
            self._num_bad,
            self._patience,
        )
        return self._num_bad >= self._patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self._best, "num_bad": self._num_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._best = state["best"]
        self._num_bad = int(state["num_bad"])
