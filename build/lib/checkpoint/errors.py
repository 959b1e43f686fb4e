"""What goes wrong with checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from gangs import Gang, run_on_all_ranks

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or a stored one is damaged or does not fit this run."""


def on_all_ranks(root: Gang, what: str, action: Callable[[], T]) -> T:
    """``action`` on every rank of ``root``; a failure on any is a CheckpointError on every
    rank, naming ``what`` was being done."""
    return run_on_all_ranks(root, action, what=what, error_type=CheckpointError)


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint matches the request."""


class CheckpointLayoutError(CheckpointError):
    """An intact checkpoint was saved by another world layout (world, DP or TP size)."""


class CheckpointDirectoryError(CheckpointError):
    """The ranks do not share one checkpoint directory (no shared filesystem)."""


class CheckpointLoadError(CheckpointError):
    """An intact checkpoint (every file matches its digest) failed to load for a reason of the
    machine: out of memory, a failed import, a read error. Not damage: it is not skipped."""


# What a load can fail of while the checkpoint's bytes are as they were written.
_MACHINE_ERRORS = (MemoryError, torch.OutOfMemoryError, ImportError, OSError)


def caused_by_the_machine(error: BaseException) -> bool:
    """Whether ``error`` or what it came of (``__cause__``, else ``__context__``) is a failure of
    the machine rather than of a checkpoint's content (a refused pickle, a shape that does not
    fit)."""
    return any(isinstance(cause, _MACHINE_ERRORS) for cause in exception_chain(error))


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what it came of: its ``__cause__``, else its ``__context__``, and so on
    (each once: a chain may loop back)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        yield cause
        seen.add(id(cause))
        cause = cause.__cause__ if cause.__cause__ is not None else cause.__context__
