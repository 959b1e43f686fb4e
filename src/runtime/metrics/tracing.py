"""Named ranges in the profiler's trace: data wait, forward, backward, gradient sync and
normalization, optimizer step, validation, checkpoint.

A range costs a ``torch.profiler.record_function`` only when the Trainer has a profiler. The
step's phases are wrapped in theirs when the step is built (:func:`traced`), so that a step
without a profiler enters no context for them; the rarer ranges (validation, checkpoint) use
:func:`trace_range`, which returns one shared no-op context without a profiler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Final, ParamSpec, TypeVar

# torch.profiler's own import takes a tenth of a second; this is the same class.
from torch.autograd.profiler import record_function

DATA_WAIT: Final = "trainkit/data_wait"
FORWARD: Final = "trainkit/forward"
BACKWARD: Final = "trainkit/backward"
GRADIENT_SYNC: Final = "trainkit/gradient_sync_and_normalization"
OPTIMIZER_STEP: Final = "trainkit/optimizer_step"
VALIDATION: Final = "trainkit/validation"
CHECKPOINT: Final = "trainkit/checkpoint"

_OFF: Final = contextlib.nullcontext()

P = ParamSpec("P")
R = TypeVar("R")


def trace_range(name: str, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return record_function(name) if enabled else _OFF


def traced(name: str, phase: Callable[P, R], *, enabled: bool) -> Callable[P, R]:
    """``phase`` run in the range ``name`` of the profiler's trace if ``enabled``, else
    ``phase`` itself."""
    if not enabled:
        return phase

    def run_in_range(*args: P.args, **kwargs: P.kwargs) -> R:
        with record_function(name):
            return phase(*args, **kwargs)

    return run_in_range
