"""What every case gets from the command line, and the step-time contenders several cases share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from benchmarks.loops import LOOPS, missing_requirement
from benchmarks.runner import Contender, Metric


@final
@dataclass(frozen=True)
class SuiteSettings:
    quick: bool
    checkpoint_params_millions: float


STEP_TIME = Metric("step_time_s", "step time", "s")
PEAK_RSS = Metric("max_rss_bytes", "peak RSS", "bytes")
HAND_WRITTEN = LOOPS["hand"].label


def step_contender(
    loop: str,
    workload: str,
    settings: SuiteSettings,
    *,
    nproc: int = 1,
    num_prefetch: int = 0,
    name: str | None = None,
) -> Contender:
    args = ["--workload", workload, "--loop", loop, "--num-prefetch", str(num_prefetch)]
    if settings.quick:
        args.append("--quick")
    return Contender(
        name=name or LOOPS[loop].label,
        module="benchmarks.step_worker",
        args=tuple(args),
        nproc=nproc,
        skip_reason=missing_requirement(loop),
    )


def all_loops(
    workload: str, settings: SuiteSettings, *, nproc: int = 1, also: tuple[str, ...] = ()
) -> tuple[Contender, ...]:
    """The hand-written loop, the frameworks, the loops in ``also`` and this project's Trainer,
    in the table's order."""
    return tuple(
        step_contender(loop, workload, settings, nproc=nproc)
        for loop in ("hand", "lightning", "torchtnt", "accelerate", *also, "trainer")
    )
