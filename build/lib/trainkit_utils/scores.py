"""Comparing validation scores: which of two is better, for scores where lower or higher is."""

from __future__ import annotations

import math


def score_key(score: float, *, lower_better: bool) -> float:
    """``score`` oriented so that a smaller key is a better score."""
    return score if lower_better else -score


def is_better_score(
    score: float, than: float | None, *, lower_better: bool, min_delta: float = 0.0
) -> bool:
    """Whether ``score`` improves on ``than`` by more than ``min_delta``.

    A NaN or infinite score (a diverged model) never does; any finite score improves on ``None``.
    """
    if not math.isfinite(score):
        return False
    if than is None:
        return True
    return (
        score_key(than, lower_better=lower_better) - score_key(score, lower_better=lower_better)
        > min_delta
    )
