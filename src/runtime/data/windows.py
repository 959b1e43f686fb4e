"""The window directory protocol: a stream of data that arrives in windows, one directory each.

``root`` holds one subdirectory per window; windows are read in the order of their names (so
name them to sort: ``2026-01-01T00``, ``window_000042``). A window is *ready* once it contains a
:data:`READY_MARKER` file, which its producer writes last: a window still being written is never
read, and the windows after it wait for it: none is skipped. A :data:`STOP_MARKER` file in
``root`` says that no window after those already ready will come (a window not ready by then
never will be, and is skipped). Names starting with ``.`` or ``_`` are never windows (temporary
directories of producers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, TypeVar

READY_MARKER: Final = "_SUCCESS"
"""The file whose presence in a window directory makes the window ready."""

STOP_MARKER: Final = "_STOP"
"""The file whose presence in ``root`` ends the stream after the windows already ready."""

T = TypeVar("T")


def window_names(root: Path) -> list[str]:
    """The names of the windows in ``root``, ready or not, in reading order."""
    return sorted(
        entry.name
        for entry in root.iterdir()
        if entry.name[:1] not in (".", "_") and entry.is_dir()
    )


def is_ready(window: Path) -> bool:
    """Whether the window directory ``window`` holds the ready marker."""
    return (window / READY_MARKER).is_file()


def stream_stopped(root: Path) -> bool:
    """Whether the stop marker is in ``root``."""
    return (root / STOP_MARKER).is_file()


def load_window_files(
    load_file: Callable[[Path], Sequence[T]], *, pattern: str = "*"
) -> Callable[[Path], list[T]]:
    """A ``load_window`` that concatenates ``load_file(path)`` over the window's files matching
    ``pattern``, in name order (markers and hidden files left out)."""

    def load_window(window: Path) -> list[T]:
        examples: list[T] = []
        for path in sorted(window.glob(pattern)):
            if path.is_file() and path.name[:1] not in (".", "_"):
                examples.extend(load_file(path))
        return examples

    return load_window


def mark_ready(window: Path) -> None:
    """Mark ``window`` ready: for producers, after every file of the window is written."""
    (window / READY_MARKER).touch()


def mark_stopped(root: Path) -> None:
    """Say that no window after those already ready will come."""
    (root / STOP_MARKER).touch()


__all__ = [
    "READY_MARKER",
    "STOP_MARKER",
    "load_window_files",
    "mark_ready",
    "mark_stopped",
    "is_ready",
    "stream_stopped",
    "window_names",
]
