"""The suite's cases, in the order they run. Each is one module with a ``KEY`` and
``comparisons(settings) -> list[Comparison]``.

To add a case (a memory figure of a new runtime feature, say), write one module here that builds
its :class:`~benchmarks.runner.Comparison` objects (a worker module if no existing worker fits) and
add it to ``CASES``; the runner, the statistics and the report need nothing else.
"""

from __future__ import annotations

from types import ModuleType

from benchmarks.cases import (
    checkpoint,
    checkpoint_loads,
    data_bound,
    gpu_checkpoint,
    gpu_llama,
    gpu_overhead,
    imports,
    large_models,
    lm_recipe,
    moe,
    text_data,
    w1_instructions,
    w1_mlp,
    w1_paired,
    w2_lm,
    w3_ddp,
    w3_paired,
)
from benchmarks.cases.base import SuiteSettings

CASES: tuple[ModuleType, ...] = (
    w1_mlp,
    w1_paired,
    w1_instructions,
    w2_lm,
    w3_ddp,
    w3_paired,
    data_bound,
    text_data,
    checkpoint,
    checkpoint_loads,
    imports,
    large_models,
    lm_recipe,
    moe,
    gpu_overhead,
    gpu_llama,
    gpu_checkpoint,
)
CASE_KEYS: tuple[str, ...] = tuple(case.KEY for case in CASES)

__all__ = ["CASES", "CASE_KEYS", "SuiteSettings"]
