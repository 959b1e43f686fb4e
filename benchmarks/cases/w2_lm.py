"""W2: the char-LM recipe's 2-layer transformer, 16 x 128 targets a step, one process."""

from __future__ import annotations

from benchmarks.cases.base import HAND_WRITTEN, PEAK_RSS, STEP_TIME, SuiteSettings, all_loops
from benchmarks.runner import Comparison

KEY = "W2"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        Comparison(
            key=KEY,
            title="2-layer transformer LM, 1 process",
            baseline=HAND_WRITTEN,
            metrics=(STEP_TIME, PEAK_RSS),
            contenders=all_loops("lm", settings),
        )
    ]
