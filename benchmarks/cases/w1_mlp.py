"""W1: MLP 32-64-64-10, batch 32, one process: the loop's own cost, nearly nothing else."""

from __future__ import annotations

from benchmarks.cases.base import HAND_WRITTEN, PEAK_RSS, STEP_TIME, SuiteSettings, all_loops
from benchmarks.runner import Comparison

KEY = "W1"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        Comparison(
            key=KEY,
            title="MLP 32-64-64-10, batch 32, 1 process",
            baseline=HAND_WRITTEN,
            metrics=(STEP_TIME, PEAK_RSS),
            # The hand-written loop doing the Trainer's required work per step (shuffled reads,
            # normalization after backward, the gradient norm): what is left is the Trainer's own.
            contenders=all_loops("mlp", settings, also=("hand_same_work",)),
        )
    ]
