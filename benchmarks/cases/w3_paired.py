"""W3 paired: the Trainer's cost over the hand-written DDP loop on 2 ranks, taking turns: the loop
as a user writes it (averaging per-rank mean losses), and the same loop normalizing over the
ranks' targets as the Trainer does, which costs it an all-reduce of the count every step."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings, paired_comparison
from benchmarks.runner import Comparison

KEY = "W3-paired"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        paired_comparison(
            key=KEY,
            title="W3, the Trainer and the hand-written DDP loop taking turns on 2 ranks",
            settings=settings,
            nproc=2,
            hands=("plain", "counted"),
        )
    ]
