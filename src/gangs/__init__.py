"""Process groups: who trains with whom, and how the ranks agree."""

from __future__ import annotations

from gangs.agreement import agree, decide_on_rank_zero, find_disagreements, run_on_all_ranks
from gangs.gang import (
    FakeGang,
    Gang,
    GangError,
    PendingCollective,
    ProcessGroupGang,
    ReduceOperation,
    is_collective_timeout,
)
from gangs.launch import LaunchBarrier, LaunchRefused
from gangs.setup import (
    Gangs,
    GangSizeError,
    default_device,
    setup_gangs,
    setup_parallel_gangs,
    setup_root_gang,
)

__all__ = [
    "FakeGang",
    "Gang",
    "GangError",
    "GangSizeError",
    "Gangs",
    "LaunchBarrier",
    "LaunchRefused",
    "PendingCollective",
    "ProcessGroupGang",
    "ReduceOperation",
    "agree",
    "decide_on_rank_zero",
    "default_device",
    "find_disagreements",
    "is_collective_timeout",
    "run_on_all_ranks",
    "setup_gangs",
    "setup_parallel_gangs",
    "setup_root_gang",
]
