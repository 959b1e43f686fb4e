"""The training loops the step-time comparisons run: one module per contender.

Each module has ``run(workload, plan, options) -> float``, the seconds per step after warm-up.
A loop run under ``torchrun`` trains data-parallel over the gang (gloo), each rank a batch of
``workload.batch_size``.
"""

from __future__ import annotations

from benchmarks.loops.registry import LOOPS, LoopInfo, LoopOptions, missing_requirement, run_loop

__all__ = ["LOOPS", "LoopInfo", "LoopOptions", "missing_requirement", "run_loop"]
