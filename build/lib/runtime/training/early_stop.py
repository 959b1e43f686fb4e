"""Stopping the training when the validation score stops improving."""

from __future__ import annotations

import logging
from typing import Any, Protocol, final

from trainkit_utils.arguments import check_not_negative, check_positive
from trainkit_utils.scores import is_better_score

log = logging.getLogger(__name__)


class EarlyStopper(Protocol):
    """Any callable ``(step_nr, score) -> bool``; ``True`` stops the training."""

    def __call__(self, step_nr: int, score: float) -> bool: ...


@final
class PatienceEarlyStopper:
    """Stops after ``patience`` validations in a row without an improvement over ``min_delta``.

    The first finite score is the reference; a later score improves on the best so far only by
    more than ``min_delta`` (downwards when ``lower_better``, upwards otherwise); a NaN or
    infinite score never does. Its state (the best score and the count of validations without
    an improvement) is checkpointed by the Trainer, so a resumed run stops where an
    uninterrupted one would.
    """

    def __init__(self, patience: int, min_delta: float = 0.0, lower_better: bool = True) -> None:
        check_positive("patience", patience)
        check_not_negative("min_delta", min_delta)
        self._patience = patience
        self._min_delta = min_delta
        self._lower_better = lower_better
        self._best: float | None = None
        self._num_bad = 0

    @property
    def lower_better(self) -> bool:
        return self._lower_better

    def __call__(self, step_nr: int, score: float) -> bool:
        # A non-finite score (a diverged model) is never an improvement, nor the reference.
        if is_better_score(
            score, self._best, lower_better=self._lower_better, min_delta=self._min_delta
        ):
            self._best = score
            self._num_bad = 0
            return False
        self._num_bad += 1
        log.info(
            "No improvement over the best score %s at step %d (%d of %d).",
            "(none yet)" if self._best is None else f"{self._best:g}",
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
