"""W3: W1 on 2 DDP ranks over gloo, under torchrun: what each step's collectives cost."""

from __future__ import annotations

from benchmarks.cases.base import HAND_WRITTEN, PEAK_RSS, STEP_TIME, SuiteSettings, all_loops
from benchmarks.runner import Comparison

KEY = "W3"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        Comparison(
            key=KEY,
            title="W1 on 2 DDP ranks (gloo)",
            baseline=HAND_WRITTEN,
            metrics=(STEP_TIME, PEAK_RSS),
            contenders=all_loops("mlp", settings, nproc=2),
            notes=("Peak RSS is rank 0's.",),
        )
    ]
