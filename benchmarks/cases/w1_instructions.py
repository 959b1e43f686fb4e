"""W1 instructions: CPU instructions per step, counted by callgrind, exact from run to run."""

from __future__ import annotations

from benchmarks.cases.base import HAND_WRITTEN, SuiteSettings
from benchmarks.instructions_worker import missing_tool
from benchmarks.loops import LOOPS
from benchmarks.runner import Comparison, Contender, Metric

KEY = "W1-instructions"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    skip_reason = missing_tool()
    args = ("--quick",) if settings.quick else ()
    return [
        Comparison(
            key=KEY,
            title="W1, CPU instructions per step (callgrind), 1 process",
            baseline=HAND_WRITTEN,
            metrics=(Metric("instructions_per_step", "instructions per step", "count"),),
            contenders=tuple(
                Contender(
                    name=LOOPS[loop].label,
                    module="benchmarks.instructions_worker",
                    args=("--workload", "mlp", "--loop", loop, *args),
                    skip_reason=skip_reason,
                )
                for loop in ("hand", "hand_same_work", "trainer")
            ),
            notes=(
                "Instructions of the steps after warm-up; with the hash seed fixed, the same "
                "from run to run whatever the host does: the cost of the runtime's own work "
                "without the noise of a shared machine. Cache misses and waits do not show in "
                "a count, so the timed W1 remains the figure the target is set on.",
            ),
        )
    ]
