"""File writes that leave a reader the old file or the whole new one, never half; the durable
ones also survive a crash of the machine (the data and the directory entry are flushed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
