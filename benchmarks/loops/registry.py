"""Loops by name, the package each needs, and how to run one."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import final

from benchmarks.workloads import StepPlan, Workload


@final
@dataclass(frozen=True)
class LoopOptions:
    num_prefetch: int = 0
    """This project's reader only: batches prepared ahead by its background thread."""


@final
@dataclass(frozen=True)
class LoopInfo:
    label: str
    module: str
    requires: str | None = None
    """A package that is not a dependency of this project (the ``bench`` extra installs it)."""


LOOPS: dict[str, LoopInfo] = {
    "hand": LoopInfo("hand-written", "benchmarks.loops.hand_loop"),
    "hand_same_work": LoopInfo(
        "hand-written + the Trainer's work", "benchmarks.loops.hand_same_work_loop"
    ),
    "trainer": LoopInfo("this project", "benchmarks.loops.trainer_loop"),
    "lightning": LoopInfo("Lightning", "benchmarks.loops.lightning_loop", "lightning"),
    "torchtnt": LoopInfo("torchtnt", "benchmarks.loops.torchtnt_loop", "torchtnt"),
    "accelerate": LoopInfo("Accelerate", "benchmarks.loops.accelerate_loop", "accelerate"),
}


def missing_requirement(name: str) -> str | None:
    """Why loop ``name`` cannot run in this environment, or None when it can."""
    package = LOOPS[name].requires
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"{package} is not installed (pip install -e '.[bench]')"


def run_loop(name: str, workload: Workload, plan: StepPlan, options: LoopOptions) -> float:
    try:
        info = LOOPS[name]
    except KeyError:
        raise ValueError(
            f"loop must be one of {', '.join(LOOPS)}, but is {name!r} instead."
        ) from None
    seconds: float = importlib.import_module(info.module).run(workload, plan, options)
    return seconds
