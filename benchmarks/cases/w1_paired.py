"""W1 paired: the Trainer's cost over the hand-written loop, on a host too noisy for W1's ratio."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings, paired_comparison
from benchmarks.runner import Comparison

KEY = "W1-paired"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        paired_comparison(
            key=KEY,
            title="W1, the Trainer and the hand-written loop taking turns in one process",
            settings=settings,
        )
    ]
