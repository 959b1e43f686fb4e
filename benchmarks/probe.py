"""The child side: what a benchmark process uses to time itself and report its figures.

Kept free of a top-level ``import torch`` so the import-time case can use it before torch loads.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import final

from benchmarks.runner import RESULT_PREFIX

# Called where the timed steps begin and end: a measurement wrapped around the loop (instruction
# counting) sees the same steps as the timer, whichever loop runs them.
_window_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None


def watch_timed_steps(*, begin: Callable[[], None], end: Callable[[], None]) -> None:
    """Call ``begin`` where every :class:`StepTimer` of this process starts timing, ``end``
    where it stops."""
    global _window_hooks
    _window_hooks = (begin, end)


def use_one_thread() -> None:
    """One intra-op thread, whatever the environment says: the runs share a small machine."""
    import torch

    torch.set_num_threads(1)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def peak_rss_bytes() -> float:
    # Linux reports kilobytes, macOS bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


def emit(figures: dict[str, float], *, with_rss: bool = True) -> None:
    """Print the result line the parent reads; only rank 0 speaks for a gang."""
    if rank() != 0:
        return
    record = dict(figures)
    if with_rss:
        record["max_rss_bytes"] = peak_rss_bytes()
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def exit_now() -> None:
    """Leave without tearing anything down, once the figures are printed.

    torch 2.13 can deadlock in teardown: a DDP module that outlives its gloo process group
    destroys the group when it is collected, and ``~ProcessGroupGloo`` joins gloo's thread while
    holding the GIL that thread is waiting for. A benchmark has nothing left to clean up (the
    runner removes its scratch directory), so it skips teardown rather than risk the hang.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@final
class StepTimer:
    """Per-step time over the steps after ``num_warmup``: call :meth:`step_end` after every step."""

    def __init__(self, *, num_warmup: int, num_steps: int) -> None:
        if not 0 < num_warmup < num_steps:
            raise ValueError(
                f"num_warmup must be in (0, num_steps={num_steps}), but is {num_warmup} instead."
            )
        self._num_warmup = num_warmup
        self._num_steps = num_steps
        self._num_seen = 0
        self._start: float | None = None
        self._end: float | None = None

    def step_end(self) -> None:
        self._num_seen += 1
        if self._num_seen == self._num_warmup:
            if _window_hooks is not None:
                _window_hooks[0]()
            self._start = time.perf_counter()
        elif self._num_seen == self._num_steps:
            self._end = time.perf_counter()
            if _window_hooks is not None:
                _window_hooks[1]()

    def seconds_per_step(self) -> float:
        if self._start is None or self._end is None:
            raise RuntimeError(
                f"The timer saw {self._num_seen} step ends, fewer than the {self._num_steps} "
                "it was set up for; the loop stopped early."
            )
        return (self._end - self._start) / (self._num_steps - self._num_warmup)
