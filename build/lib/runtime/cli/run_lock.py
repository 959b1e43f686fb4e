"""One run per output directory, and workers that do not outlive their launcher.

Rank 0 holds ``OUTPUT_DIR/run.lock`` while the run lives: an exclusive ``flock`` on the file (the
kernel drops it when the process dies, however it dies) plus a JSON record of the holder (host,
pid, start time) whose ``heartbeat`` rank 0 refreshes every few seconds. A second run is refused
with a message naming the holder. A lock whose holder is gone is taken over: on the same host a
dead pid (the ``flock`` is free), on another host a heartbeat older than ``stale_after`` (a
``flock`` need not reach across machines on a network filesystem).

``torchrun`` starts each worker in a session of its own, so a launcher killed by SIGKILL (the OOM
killer, a scheduler) leaves its workers running. :class:`LauncherWatchdog` notices within about a
second that the worker's parent changed and ends the process at once, before it trains or saves
anything more; a save it cuts short stays an uncommitted ``.tmp`` directory, as after any crash.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, final

log = logging.getLogger(__name__)

LOCK_FILE_NAME: Final = "run.lock"


class RunLockError(RuntimeError):
    """The output directory is in use by another live run."""


@final
class RunLock:
    """The exclusive claim of one run on an output directory; see the module docstring."""

    def __init__(
        self,
        output_dir: Path,
        *,
        heartbeat_interval: float = 5.0,
        stale_after: float = 60.0,
    ) -> None:
        if heartbeat_interval <= 0 or stale_after <= heartbeat_interval:
            raise ValueError(
                "stale_after must exceed heartbeat_interval and both must be greater than zero, "
                f"but are {stale_after} and {heartbeat_interval} instead."
            )
        self._path = output_dir / LOCK_FILE_NAME
        self._heartbeat_interval = heartbeat_interval
        self._stale_after = stale_after
        self._fd: int | None = None
        self._record: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self._path

    def acquire(self) -> None:
        """Claim the directory or raise :class:`RunLockError` naming the live holder."""
        while True:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_record(fd)
                os.close(fd)
                raise RunLockError(self._in_use_message(holder, "holds its lock")) from None
            # A releaser unlinks the file under the flock; then ours is on a dead inode: retry.
            if _same_file(fd, self._path):
                break
            os.close(fd)
        try:
            self._take_over(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the directory up: remove the lock file (under the lock) and stop the heartbeat."""
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def _take_over(self, fd: int) -> None:
        previous = _read_record(fd)
        if previous:
            age = time.time() - float(previous.get("heartbeat", 0.0))
            same_host = previous.get("host") == socket.gethostname()
            if not same_host and age < self._stale_after:
                raise RunLockError(
                    self._in_use_message(previous, f"sent a heartbeat {age:.0f} s ago")
                )
            why = "is dead" if same_host else f"sent its last heartbeat {age:.0f} s ago"
            log.warning(
                "Taking over the lock %s left by pid %s on %s, which %s.",
                self._path,
                previous.get("pid"),
                previous.get("host"),
                why,
            )
        self._record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "heartbeat": time.time(),
        }
        _write_record(fd, self._record)

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_interval):
            fd = self._fd
            if fd is None:
                return
            self._record["heartbeat"] = time.time()
            try:
                _write_record(fd, self._record)
            except OSError as ex:
                log.warning("Cannot refresh the heartbeat in %s: %s", self._path, ex)

    def _in_use_message(self, holder: dict[str, Any], evidence: str) -> str:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
        started = holder.get("started")
        since = ""
        if isinstance(started, int | float):
            since = f", running since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
        return (
            f"The output directory {self._path.parent} is in use by another run ({who}{since}), "
            f"which {evidence}. Wait for it to end or stop it, or pass another OUTPUT_DIR. If that "
            f"run is surely gone, delete {self._path}."
        )


def _read_record(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(fd: int, record: dict[str, Any]) -> None:
    # One write at offset 0, padded instead of truncated first: a reader never sees an empty file.
    data = json.dumps(record).encode("utf-8")
    os.pwrite(fd, data.ljust(256), 0)
    os.ftruncate(fd, max(len(data), 256))
    os.fsync(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


@final
class LauncherWatchdog:
    """Ends this worker soon after its launcher (its parent process) dies.

    Only meaningful under ``torchrun`` (``TORCHELASTIC_RUN_ID`` set), where the parent is the
    elastic agent; a process started from a shell keeps running when the shell goes away.
    """

    def __init__(
        self,
        *,
        interval: float = 0.5,
        on_orphaned: Callable[[int], None] | None = None,
    ) -> None:
        self._parent = os.getppid()
        self._interval = interval
        self._on_orphaned = on_orphaned or _exit_now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="launcher-watchdog", daemon=True)

    @staticmethod
    def wanted() -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            if os.getppid() != self._parent:
                self._on_orphaned(self._parent)
                return


def _exit_now(launcher_pid: int) -> None:
    log.error(
        "The launcher (pid %d) died; exiting without training or saving anything more.",
        launcher_pid,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    # What the launcher would have done. An orderly exit is not to be had: the main thread may
    # wait in a collective for peers that are gone, and nothing of the run may be saved now.
    os.kill(os.getpid(), signal.SIGKILL)
