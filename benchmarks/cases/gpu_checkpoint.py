"""G2 checkpoint: an async checkpoint of G2's model with its AdamW state, on one GPU: how long
the caller is blocked (goal: under 0.1 s), save and load GB/s."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings, no_cuda_reason
from benchmarks.runner import Comparison, Contender, Metric

KEY = "G2-checkpoint"
THIS_PROJECT = "this project"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        Comparison(
            key=KEY,
            title="G2's model and AdamW state (13 GB in float32), async checkpoint from one GPU",
            baseline=THIS_PROJECT,
            metrics=(
                Metric("async_blocked_s", "async save, caller blocked", "s", ratio=False),
                Metric(
                    "async_blocked_later_s", "a later async save, caller blocked", "s", ratio=False
                ),
                Metric("save_gb_per_s", "save (call to commit)", "GB/s", ratio=False),
                Metric("load_gb_per_s", "load", "GB/s", ratio=False),
            ),
            contenders=(
                Contender(
                    name=THIS_PROJECT,
                    module="benchmarks.gpu_worker",
                    args=("--checkpoint", *(("--quick",) if settings.quick else ())),
                    skip_reason=no_cuda_reason(),
                ),
            ),
            notes=(
                "Blocked: the save_checkpoint call, which stages the GPU tensors into pinned host "
                "memory; the write runs in the background. GB/s: the checkpoint's bytes over the "
                "time from the call to the commit (save), and of a load back onto the GPU. Goal: "
                "blocked under 0.1 s.",
            ),
        )
    ]
