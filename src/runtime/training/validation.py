"""Validation during training: the valid units, the score and its best, the early stop."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, final

from torch.nn import Module

from checkpoint.state_keys import check_state_keys
from gangs import Gangs, decide_on_rank_zero
from runtime.data import DataReader
from runtime.errors import TrainerError
from runtime.metrics.recorders import MetricRecorder
from runtime.metrics.tracing import VALIDATION, trace_ranges
from runtime.training.early_stop import EarlyStopper
from runtime.training.evaluation import AutocastFactory, Evaluator, combine_scores
from runtime.training.state import Stateful
from trainkit_utils.arguments import check_positive, check_same_length
from trainkit_utils.scores import is_better_score
from units import EvalUnit
from units.callback import TrainerCallback

log = logging.getLogger(__name__)


@final
@dataclass(frozen=True)
class Scoring:
    """How validations are ranked: the metric that scores them and its orientation, and the
    early stopper that watches the score. The one place ``lower_better`` is kept: the
    retention of the best checkpoints, the best score and ``evaluate_checkpoint("best")``
    all read it here."""

    metric_name: str | None = None
    lower_better: bool = False
    early_stopper: EarlyStopper | None = None

    def __post_init__(self) -> None:
        stopper_lower_better = getattr(self.early_stopper, "lower_better", None)
        if isinstance(stopper_lower_better, bool) and stopper_lower_better != self.lower_better:
            raise ValueError(
                f"early_stopper ranks scores with lower_better={stopper_lower_better}, but the "
                f"Trainer has lower_better={self.lower_better}. Give both the same orientation."
            )


@final
class Validator:
    """Runs the valid units, combines their score, keeps the best, and asks the early stopper.

    Every rank validates (the values are synced over the DP gang, so all ranks see the same);
    rank 0 alone asks the early stopper and the others follow its decision.
    """

    def __init__(
        self,
        *,
        units: Sequence[EvalUnit[Any]],
        data_readers: Sequence[DataReader[Any]],
        model: Module,
        gangs: Gangs,
        recorder: MetricRecorder,
        autocast: AutocastFactory,
        scoring: Scoring,
        callbacks: TrainerCallback,
        trace: bool = False,
        max_num_steps: int | None = None,
    ) -> None:
        check_positive("max_num_valid_steps", max_num_steps)
        check_same_length("valid_units", units, "valid_data_readers", data_readers)
        self._evaluator: Evaluator | None = None
        if units:
            self._evaluator = Evaluator(
                model=model,
                units=units,
                data_readers=data_readers,
                gangs=gangs,
                recorder=recorder,
                run_prefix="valid",
                autocast=autocast,
                max_num_steps=max_num_steps,
            )
        self._root_gang = gangs.root
        self._scoring = scoring
        self._early_stopper = scoring.early_stopper
        self._callbacks = callbacks
        self._range = trace_ranges(trace)
        self.last_validated_step: int | None = None
        self._last_score: float | None = None
        self._best_score: float | None = None
        self._best_step_nr: int | None = None

    @property
    def has_units(self) -> bool:
        return self._evaluator is not None

    def evaluator(self, *, run_prefix: str) -> Evaluator:
        """An evaluator of the valid units that publishes under ``run_prefix``."""
        if self._evaluator is None:
            raise ValueError("Evaluating a checkpoint needs valid_units and valid_data_readers.")
        return self._evaluator.with_run_prefix(run_prefix)

    def score_at(self, step_nr: int) -> float | None:
        """The score of the validation at ``step_nr``, for its checkpoint; None if unscored."""
        return self._last_score if self.last_validated_step == step_nr else None

    def validate(self, step_nr: int, *, baseline: bool = False) -> bool:
        """Run every valid unit to the end of its data; return whether to stop early.

        A ``baseline`` validation (``validate_at_start``, before the first step) publishes its
        values, but its score neither competes for the best nor goes to the early stopper: no
        checkpoint holds the untrained model.
        """
        assert self._evaluator is not None
        self.last_validated_step = step_nr
        with self._range(VALIDATION):
            results = self._evaluator.run(step_nr)
        for run, values in results.items():
            self._callbacks.on_metrics_published(run=run, step_nr=step_nr, values=values)

        score = None
        if self._scoring.metric_name is not None:
            score = combine_scores(results, self._scoring.metric_name)
            if baseline:
                log.info("Validation score before training: %g (a baseline, not ranked).", score)
            else:
                self._record_score(step_nr, score)
        self._callbacks.on_validation_end(step_nr=step_nr, score=score, results=results)
        return score is not None and not baseline and self._ask_early_stopper(step_nr, score)

    def _record_score(self, step_nr: int, score: float) -> None:
        # A non-finite score (a diverged model) is never the best, and its checkpoint is stored
        # unscored, so keep-best and --evaluate best never pick it.
        finite = math.isfinite(score)
        self._last_score = score if finite else None
        if is_better_score(score, self._best_score, lower_better=self._scoring.lower_better):
            self._best_score, self._best_step_nr = score, step_nr
        if not finite:
            log.warning(
                "The validation score at step %d is %g: it never counts as the best.",
                step_nr,
                score,
            )
        if self._best_score is not None:
            log.info(
                "Validation score at step %d: %g (best: %g at step %s).",
                step_nr,
                score,
                self._best_score,
                self._best_step_nr,
            )

    def _ask_early_stopper(self, step_nr: int, score: float) -> bool:
        if self._early_stopper is None:
            return False
        stopper = self._early_stopper
        # A stopper that raises fails every rank with a clear error, instead of leaving the
        # others waiting in the broadcast for a rank that is gone.
        stop: bool = decide_on_rank_zero(
            self._root_gang,
            lambda: bool(stopper(step_nr, score)),
            on_failure=lambda cause: TrainerError(
                f"The early stopper failed on rank 0 at step {step_nr}: {cause}"
            ),
        )
        if stop:
            log.info("The early stopper stopped the training at step %d.", step_nr)
            self._callbacks.on_early_stop(step_nr=step_nr, score=score)
        return stop

    def log_best(self) -> None:
        if self._best_score is not None:
            log.info(
                "The best validation score was %g, at step %s.",
                self._best_score,
                self._best_step_nr,
            )

    def state_dict(self) -> dict[str, Any]:
        stopper = self._early_stopper
        return {
            "last_score": self._last_score,
            "best_score": self._best_score,
            "best_step_nr": self._best_step_nr,
            "last_validated_step": self.last_validated_step,
            "early_stopper": stopper.state_dict() if isinstance(stopper, Stateful) else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(state, self.state_dict(), what="validation")
        self._last_score = state["last_score"]
        self._best_score = state["best_score"]
        self._best_step_nr = state["best_step_nr"]
        self.last_validated_step = state["last_validated_step"]
        # A stopper added since the checkpoint starts afresh; one removed leaves its state unused.
        if isinstance(self._early_stopper, Stateful) and state["early_stopper"] is not None:
            self._early_stopper.load_state_dict(state["early_stopper"])
