"""G1 paired: the Trainer's host overhead on one GPU. An MLP whose step keeps the GPU busy for
about a millisecond; the Trainer and the hand-written loop take turns (goal: <= 1.02x)."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings, no_cuda_reason, paired_comparison
from benchmarks.runner import Comparison

KEY = "G1-paired"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        paired_comparison(
            key=KEY,
            title="G1, one GPU: MLP 1024-4096-4096-1024 in float32, batch 256, the Trainer and "
            "the hand-written loop taking turns (goal: Trainer / hand-written <= 1.02)",
            settings=settings,
            workload="gpu_mlp",
            skip_reason=no_cuda_reason(),
        )
    ]
