"""Writes that survive a crash: a reader sees the old file or the whole new one, never half."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

_SYNC_FILE_RANGE_WRITE: Final = 2


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (no fsync: for files a crash may lose)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def write_json_durably(obj: Any, file: Path) -> None:
    """Replace ``file`` with ``obj`` as JSON, flushed to disk with its directory entry."""
    tmp = file.with_name(file.name + ".partial")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    fsync_dir(file.parent)


def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing ``length`` bytes of ``fd`` from ``offset`` to disk, and
    return without waiting for them (Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``).

    Only a head start for the ``fsync`` that must follow: it makes nothing durable by itself. A
    large file written in full and then fsynced keeps the disk idle while it is written and the
    CPU idle while it is flushed; started as the bytes arrive, the two overlap. Where the call is
    missing (not Linux) this does nothing, and the ``fsync`` does all the writing as before.
    """
    import ctypes  # on first use: the CLI imports this module, and ctypes is not free to load

    sync_file_range = libc_function(
        "sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    )
    if sync_file_range is not None:
        sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


@functools.cache
def libc_function(name: str, argtypes: tuple[Any, ...]) -> Callable[..., int] | None:
    """The C library's function ``name``, taking ``argtypes`` (ctypes types) and returning an
    int; None where the library has none (not Linux, or a Linux too old for it)."""
    import ctypes

    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]
