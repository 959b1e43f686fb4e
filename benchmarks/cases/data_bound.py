"""A reader as slow as the step: does the reader's prefetch hide it?"""

from __future__ import annotations

from benchmarks.cases.base import HAND_WRITTEN, STEP_TIME, SuiteSettings, step_contender
from benchmarks.runner import Comparison
from benchmarks.workloads.slow_data import SlowDataWorkload

KEY = "data"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    delay_ms = SlowDataWorkload.example_delay_s * 1e3
    return [
        Comparison(
            key=KEY,
            title="data-bound MLP 256-512-512-10, batch 16, 1 process",
            baseline=HAND_WRITTEN,
            metrics=(STEP_TIME,),
            contenders=(
                step_contender("hand", "slow_data", settings),
                step_contender(
                    "trainer", "slow_data", settings, name="this project, num_prefetch=0"
                ),
                step_contender(
                    "trainer",
                    "slow_data",
                    settings,
                    num_prefetch=2,
                    name="this project, num_prefetch=2",
                ),
            ),
            notes=(
                f"Every example sleeps {delay_ms:g} ms in the dataset's __getitem__, as a read "
                "from storage would; the hand-written loop reads its batch before each step.",
            ),
        )
    ]
