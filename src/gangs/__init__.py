"""Process groups: who trains with whom."""

from __future__ import annotations

from gangs.gang import FakeGang, Gang, GangError, ProcessGroupGang, ReduceOperation
from gangs.setup import Gangs, default_device, setup_gangs, setup_parallel_gangs, setup_root_gang

__all__ = [
    "FakeGang",
    "Gang",
    "GangError",
    "Gangs",
    "ProcessGroupGang",
    "ReduceOperation",
    "default_device",
    "setup_gangs",
    "setup_parallel_gangs",
    "setup_root_gang",
]
