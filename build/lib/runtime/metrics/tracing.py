"""Named ranges in the profiler's trace: data wait, forward, backward, gradient sync and
normalization, optimizer step, validation, checkpoint.

A range costs a ``torch.profiler.record_function`` only when the Trainer has a profiler. The
parts that mark ranges take their range maker once, from :func:`trace_ranges`, and write each
range inline (``with self._range(FORWARD): ...``); without a profiler the maker returns one
shared no-op context, so a step creates nothing for its ranges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Final, TypeAlias

# torch.profiler's own import takes a tenth of a second; this is the same class.
from torch.autograd.profiler import record_function

DATA_WAIT: Final = "trainkit/data_wait"
FORWARD: Final = "trainkit/forward"
BACKWARD: Final = "trainkit/backward"
GRADIENT_SYNC: Final = "trainkit/gradient_sync_and_normalization"
OPTIMIZER_STEP: Final = "trainkit/optimizer_step"
VALIDATION: Final = "trainkit/validation"
CHECKPOINT: Final = "trainkit/checkpoint"

RangeMaker: TypeAlias = Callable[[str], contextlib.AbstractContextManager[Any]]
"""Makes the context of the range of a name."""

_OFF: Final = contextlib.nullcontext()


def trace_ranges(enabled: bool) -> RangeMaker:
    """``record_function`` if ``enabled`` (a profiler runs), else a maker of the one shared
    no-op context."""
    return record_function if enabled else _no_range


def _no_range(name: str) -> contextlib.AbstractContextManager[Any]:
    return _OFF
