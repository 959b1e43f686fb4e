"""Data that arrives in windows while the run trains, one directory each: the directory protocol,
and :class:`WindowedDataReader`, which reads one window as one data epoch.

``root`` holds one subdirectory per window; windows are read in the order of their names (so
name them to sort: ``2026-01-01T00``, ``window_000042``). A window is *ready* once it contains a
:data:`READY_MARKER` file, which its producer writes last: a window still being written is never
read, and the windows after it wait for it: none is skipped. A :data:`STOP_MARKER` file in
``root`` says that no window after those already ready will come (a window not ready by then
never will be, and is skipped). Names starting with ``.`` or ``_`` are never windows (temporary
directories of producers).

Within a window the reader is a :class:`~runtime.data.map_reader.MapDataReader`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple, TypeVar, final, overload

from torch.utils.data import default_collate
from typing_extensions import override

from gangs import Gang, agree, decide_on_rank_zero, run_on_all_ranks
from runtime.data.data_reader import DataReader, DataReaderError, WaitInterrupted, int_entry
from runtime.data.map_reader import MapDataReader, MapDataset
from trainkit_utils.arguments import check_not_negative, check_positive

log = logging.getLogger(__name__)

# While it waits, rank 0 says so in the log at most this often.
_LOG_WAIT_EVERY_S = 300.0


READY_MARKER: Final = "_SUCCESS"
"""The file whose presence in a window directory makes the window ready."""

STOP_MARKER: Final = "_STOP"
"""The file whose presence in ``root`` ends the stream after the windows already ready."""

T = TypeVar("T")
BatchT = TypeVar("BatchT")


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


class _Next(NamedTuple):
    """What follows the current window, as rank 0 saw it: a window, the end (and why), or
    neither yet."""

    window: str | None
    end: str | None = None


@final
class WindowedDataReader(DataReader[BatchT]):
    """Reads the windows of ``root`` in name order, each as one data epoch, as they become ready.

    ``load_window(path)`` returns a window's examples: a list, or any map-style dataset (a lazy
    one reads only this rank's examples). Within a window the examples are read as
    :class:`MapDataReader` reads them (sharded over ``gang``, shuffled by ``seed`` plus the
    window's number, every rank ending the window at the same step), with the same
    ``collate``, ``num_accumulate``, ``shuffle``, ``drop_remainder`` and ``num_prefetch``.

    Which window comes next, and whether the stream ended (the stop marker, or
    ``max_num_windows`` windows read), is decided by rank 0 of ``root_gang`` (default: ``gang``;
    pass the root gang when there are tensor-parallel ranks) and sent to the others, so ranks
    that see the directory at different moments still agree. Waiting for a window polls every
    ``poll_interval`` seconds, one short collective a poll (so no collective outlasts its
    timeout), and fails after ``wait_timeout`` seconds (None: waits for good).

    Its position (the window's name and the step within it) resumes exactly, even after older
    windows were deleted.
    """

    @overload
    def __init__(
        self: WindowedDataReader[Any],
        *,
        root: Path | str,
        load_window: Callable[[Path], MapDataset],
        batch_size: int,
        gang: Gang,
        root_gang: Gang | None = ...,
        num_accumulate: int = ...,
        shuffle: bool = ...,
        seed: int = ...,
        drop_remainder: bool = ...,
        num_prefetch: int = ...,
        max_num_windows: int | None = ...,
        wait_timeout: float | None = ...,
        poll_interval: float = ...,
    ) -> None: ...

    @overload
    def __init__(
        self,
        *,
        root: Path | str,
        load_window: Callable[[Path], MapDataset],
        batch_size: int,
        gang: Gang,
        collate: Callable[[list[Any]], BatchT],
        root_gang: Gang | None = ...,
        num_accumulate: int = ...,
        shuffle: bool = ...,
        seed: int = ...,
        drop_remainder: bool = ...,
        num_prefetch: int = ...,
        max_num_windows: int | None = ...,
        wait_timeout: float | None = ...,
        poll_interval: float = ...,
    ) -> None: ...

    def __init__(
        self,
        *,
        root: Path | str,
        load_window: Callable[[Path], MapDataset],
        batch_size: int,
        gang: Gang,
        collate: Callable[[list[Any]], BatchT] = default_collate,
        root_gang: Gang | None = None,
        num_accumulate: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
        num_prefetch: int = 2,
        max_num_windows: int | None = None,
        wait_timeout: float | None = None,
        poll_interval: float = 10.0,
    ) -> None:
        check_positive("batch_size", batch_size)
        check_positive("num_accumulate", num_accumulate)
        check_not_negative("num_prefetch", num_prefetch)
        check_positive("max_num_windows", max_num_windows)
        check_positive("wait_timeout", wait_timeout)
        check_positive("poll_interval", poll_interval)
        self._root = Path(root)
        self._load_window = load_window
        self._gang = gang
        self._root_gang = gang if root_gang is None else root_gang
        self._max_num_windows = max_num_windows
        self._wait_timeout = wait_timeout
        self._poll_interval = poll_interval

        def make_reader(dataset: MapDataset, window_nr: int) -> MapDataReader[BatchT]:
            return MapDataReader(
                dataset=dataset,
                batch_size=batch_size,
                gang=gang,
                collate=collate,
                num_accumulate=num_accumulate,
                shuffle=shuffle,
                seed=seed + window_nr,
                drop_remainder=drop_remainder,
                num_prefetch=num_prefetch,
            )

        self._make_reader = make_reader
        self._num_accumulate = num_accumulate
        self._window: str | None = None  # None: no window opened yet
        self._window_nr = 0
        self._reader: MapDataReader[BatchT] | None = None
        # A mid-window position loaded but not applied yet: the window opens on the next read.
        self._position: Mapping[str, Any] | None = None
        self._next: _Next | None = None  # known on every rank alike once decided
        self._wait_logged_at: float | None = None  # rank 0's last "waiting" log line

    @override
    def __next__(self) -> list[BatchT]:
        if self._reader is None:
            if self._window is None:
                self._open_next()
            elif self._position is None:
                # At the end of a window whose examples need not be loaded (they may be gone).
                raise StopIteration
            else:
                self._open(self._window, self._window_nr, self._position)
        assert self._reader is not None
        return next(self._reader)

    @override
    def reset(self) -> None:
        self._open_next()

    @override
    def has_next_epoch(
        self, *, wait: bool = True, stop_requested: Callable[[], bool] | None = None
    ) -> bool:
        if self._next is None:
            upcoming = self._find_next(wait=wait, stop_requested=stop_requested)
            if upcoming.window is None and upcoming.end is None:
                return True  # not known without waiting
            self._next = upcoming
        return self._next.window is not None

    @override
    def state_dict(self) -> dict[str, object]:
        position: Mapping[str, Any] = {}
        if self._reader is not None:
            position = self._reader.state_dict()
            if int_entry(position, "step_nr") >= int_entry(position, "num_steps"):
                position = {}  # the window's end: resuming there needs none of its examples
        elif self._position is not None:
            position = self._position
        return {"window": self._window or "", "window_nr": self._window_nr, "position": position}

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        window = state.get("window")
        position = state.get("position")
        if not isinstance(window, str) or not isinstance(position, Mapping):
            raise ValueError(
                f"The data reader state has no window and position; it has {sorted(state)}. "
                "Load a state saved by a WindowedDataReader."
            )
        self._close_reader()
        self._next = None
        self._window = window or None
        self._window_nr = int_entry(state, "window_nr")
        self._position = dict(position) if position else None

    @property
    @override
    def num_accumulate(self) -> int:
        return self._num_accumulate

    @property
    def root(self) -> Path:
        return self._root

    @property
    def window(self) -> str | None:
        """The name of the window being read; None before the first."""
        return self._window

    @property
    def window_nr(self) -> int:
        """The number of the window being read, from 1 (0 before the first)."""
        return self._window_nr

    @override
    def close(self) -> None:
        self._close_reader()

    @override
    def for_evaluation(self) -> DataReader[BatchT]:
        raise ValueError(
            "A WindowedDataReader reads a stream for training; validate on a reader of a fixed "
            "set (a MapDataReader over the validation examples, say)."
        )

    # ------------------------------------------------------------ windows

    def _open_next(self) -> None:
        if self._next is None:
            self._next = self._find_next(wait=True, stop_requested=None)
        upcoming = self._next
        if upcoming.window is None:
            after = "in" if self._window is None else f"after '{self._window}' in"
            raise DataReaderError(
                f"No window follows {after} {self._root}: {upcoming.end}. Ask has_next_epoch() "
                "before reset() to learn that the stream ended."
            )
        self._open(upcoming.window, self._window_nr + 1, None)

    def _open(self, window: str, window_nr: int, position: Mapping[str, Any] | None) -> None:
        """Read ``window`` from ``position`` (its start if None); fails on every rank alike."""
        self._close_reader()
        path = self._root / window
        dataset = run_on_all_ranks(
            self._root_gang,
            lambda: self._load(path),
            what=f"load window '{window}' ({path})",
            error_type=DataReaderError,
        )
        try:
            reader = self._make_reader(dataset, window_nr)
            reader.check_has_steps()
            if position is not None:
                reader.load_state_dict(position)
        except ValueError as ex:
            raise DataReaderError(f"Window '{window}' ({path}) cannot be read: {ex}") from ex
        self._reader = reader
        self._window, self._window_nr = window, window_nr
        self._position = None
        self._next = None
        log.info("Reading window '%s' (window %d) of %s.", window, window_nr, self._root)

    def _load(self, path: Path) -> MapDataset:
        if not path.is_dir():
            raise FileNotFoundError(
                "the window directory is missing; a window must stay until the run has read past it"
            )
        dataset = self._load_window(path)
        if len(dataset) == 0:
            raise ValueError("load_window returned no examples; a ready window must have some")
        return dataset

    def _find_next(self, *, wait: bool, stop_requested: Callable[[], bool] | None) -> _Next:
        """The window after the current one, or the end of the stream, as rank 0 sees it; with
        ``wait``, polls until one of them. The same on every rank."""
        max_windows = self._max_num_windows
        if max_windows is not None and self._window_nr >= max_windows:
            return _Next(None, f"max_num_windows ({max_windows}) windows were read")
        started = time.monotonic()
        self._wait_logged_at = None
        while True:
            upcoming = decide_on_rank_zero(
                self._root_gang, lambda: self._look(started), on_failure=DataReaderError
            )
            if not wait or upcoming.window is not None or upcoming.end is not None:
                return upcoming
            requested = stop_requested is not None and stop_requested()
            if agree(self._root_gang, failed=requested)[0]:
                raise WaitInterrupted(
                    f"A stop was requested while waiting for a window of {self._root}."
                )
            time.sleep(self._poll_interval)

    def _look(self, started: float) -> _Next:
        """Rank 0's view of the directory: what follows the current window, if known yet."""
        root = self._root
        if not root.is_dir():
            raise DataReaderError(
                f"The window directory {root} does not exist. Create it (the producer writes one "
                "subdirectory per window into it) or fix the path."
            )
        # The marker first: a producer writes it after the last window is ready, so every
        # window that will ever come is in the listing that follows it.
        stopped = stream_stopped(root)
        current = self._window
        for name in window_names(root):
            if current is not None and name <= current:
                continue
            if is_ready(root / name):
                return _Next(name)
            if not stopped:
                # Never skipped while it may still become ready: the windows after it wait.
                return self._keep_waiting(started, f"window '{name}' to become ready")
            log.warning(
                "Window '%s' of %s is not ready, and the stop marker says it never will be: "
                "it is skipped.",
                name,
                root,
            )
        if stopped:
            return _Next(None, f"the stop marker {root / STOP_MARKER} is there")
        first = current is None
        return self._keep_waiting(
            started, "the first window" if first else f"a window after '{current}'"
        )

    def _keep_waiting(self, started: float, awaited: str) -> _Next:
        """Rank 0's verdict "not yet", or the timeout's error; says it waits, now and then."""
        root = self._root
        if self._wait_timeout is not None and time.monotonic() - started >= self._wait_timeout:
            raise DataReaderError(
                f"Waited wait_timeout ({self._wait_timeout} s) for {awaited} in {root}. Mark "
                f"the window ready with a {READY_MARKER} file, write {STOP_MARKER} into {root} "
                "to end the stream, or raise wait_timeout."
            )
        logged_at = self._wait_logged_at
        if logged_at is None or time.monotonic() - logged_at >= _LOG_WAIT_EVERY_S:
            self._wait_logged_at = time.monotonic()
            log.info(
                "Waiting for %s in %s (a window is ready once it holds %s; %s ends the stream).",
                awaited,
                root,
                READY_MARKER,
                STOP_MARKER,
            )
        return _Next(None)

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


__all__ = [
    "READY_MARKER",
    "STOP_MARKER",
    "WindowedDataReader",
    "load_window_files",
    "mark_ready",
    "mark_stopped",
    "is_ready",
    "stream_stopped",
    "window_names",
]
