"""Named ranges in the profiler's trace: data wait, forward, backward, gradient sync and
normalization, optimizer step, validation, checkpoint.

A range costs a ``torch.profiler.record_function`` only when the Trainer has a profiler; without
one, :func:`trace_range` returns one shared no-op context.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

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


def trace_range(name: str, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return record_function(name) if enabled else _OFF
