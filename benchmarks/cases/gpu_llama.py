"""G2: a Llama-style model of 1.1 B parameters on one GPU, bf16 autocast, compiled blocks:
tokens per second, MFU and peak memory of the Trainer, the hand-written loop, Lightning and
Accelerate (goal: Trainer >= 0.98x the hand-written loop's tokens per second)."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings, no_cuda_reason
from benchmarks.loops import LOOPS, missing_requirement
from benchmarks.runner import Comparison, Contender, Metric

KEY = "G2-llama"
METRICS = (
    Metric("tokens_per_s", "tokens per second", "count"),
    Metric("mfu", "MFU (dense bf16 peak)", "fraction"),
    Metric("peak_memory_bytes", "peak GPU memory", "bytes"),
    Metric("step_time_s", "step time", "s"),
)


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    no_cuda = no_cuda_reason()
    args = ("--quick",) if settings.quick else ()
    contenders = tuple(
        Contender(
            name=LOOPS[loop].label,
            module="benchmarks.gpu_worker",
            args=("--loop", loop, *args),
            # A framework that is not installed is a column left empty, saying why.
            skip_reason=no_cuda or missing_requirement(loop),
        )
        for loop in ("hand", "lightning", "accelerate", "trainer")
    )
    size = "a small Llama (--quick)" if settings.quick else "Llama-style 1.1 B (Llama 3.2 1B shape)"
    return [
        Comparison(
            key=KEY,
            title=f"G2, one GPU: {size}, 4 x 2048 tokens a step, bf16 autocast, compiled blocks",
            baseline=LOOPS["hand"].label,
            metrics=METRICS,
            contenders=contenders,
            notes=(
                "Every loop: float32 weights, bf16 autocast, each block torch.compile'd, fused "
                "AdamW, random tokens. The hand-written loop slices batches already on the GPU; "
                "the others load them from host memory. MFU counts 6 FLOPs per parameter and "
                "token plus attention, over the device's dense bf16 peak. Goal: the Trainer's "
                "tokens per second >= 0.98x the hand-written loop's.",
            ),
        )
    ]
