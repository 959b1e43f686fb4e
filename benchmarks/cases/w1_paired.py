"""W1 paired: the Trainer's cost over the hand-written loop, on a host too noisy for W1's ratio."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings
from benchmarks.runner import Comparison, Contender, Metric

KEY = "W1-paired"

PAIRED = "this project, each step followed by a hand-written one"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        Comparison(
            key=KEY,
            title="W1, the Trainer and the hand-written loop alternating step by step, 1 process",
            baseline=PAIRED,
            metrics=(
                Metric("trainer_step_s", "Trainer step", "s", ratio=False),
                Metric("hand_step_s", "hand-written step", "s", ratio=False),
                Metric("extra_s", "Trainer step - hand-written step", "s", ratio=False),
            ),
            contenders=(
                Contender(
                    name=PAIRED,
                    module="benchmarks.paired_worker",
                    args=("--quick",) if settings.quick else (),
                ),
            ),
            notes=(
                "Medians over each process's steps: both loops see the same moment of the "
                "host, so the difference holds where separate processes' step times do not. "
                "Each model evicts the other's caches in between, so both steps cost more "
                "than alone.",
            ),
        )
    ]
