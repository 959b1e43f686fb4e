"""The checkpoint directory on disk: what is in it, and the moves that keep it consistent.

``step_N/`` with a manifest is a committed checkpoint; ``step_N.tmp/`` (or a ``step_N/`` without
a manifest, left by an interrupted delete) is incomplete; ``step_N.damaged[K]/`` was found damaged
by a resume and moved aside. Every function here runs on one rank; the manager coordinates.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from checkpoint.durable import fsync_dir

log = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"

STEP_DIR_PATTERN: Final = re.compile(r"^step_(\d+)$")
_DAMAGED_DIR = re.compile(r"^step_\d+\.damaged\d*$")


@dataclass(frozen=True)
class DirectoryListing:
    committed: dict[int, Path]
    """Step number -> directory, for every ``step_N`` with a manifest, oldest first."""
    incomplete: list[Path]
    damaged: list[Path]


def step_dir(checkpoint_dir: Path, step_nr: int) -> Path:
    return checkpoint_dir / f"step_{step_nr}"


def scan(checkpoint_dir: Path) -> DirectoryListing:
    """Sort every entry of ``checkpoint_dir`` into committed, incomplete and damaged."""
    committed: dict[int, Path] = {}
    incomplete: list[Path] = []
    damaged: list[Path] = []
    if checkpoint_dir.is_dir():
        for path in checkpoint_dir.iterdir():
            match = STEP_DIR_PATTERN.match(path.name)
            if match is not None:
                if (path / MANIFEST_NAME).is_file():
                    committed[int(match.group(1))] = path
                else:
                    incomplete.append(path)
            elif path.name.endswith(".tmp"):
                incomplete.append(path)
            elif _DAMAGED_DIR.match(path.name):
                damaged.append(path)
    return DirectoryListing(
        committed=dict(sorted(committed.items())),
        incomplete=sorted(incomplete),
        damaged=sorted(damaged),
    )


def delete(path: Path) -> None:
    """Remove a checkpoint; the manifest goes first, so a crash midway leaves it invisible."""
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``step_N.damaged`` (or ``.damagedK``); return the target."""
    target = path.with_name(path.name + ".damaged")
    suffix = 1
    while target.exists():
        suffix += 1
        target = path.with_name(f"{path.name}.damaged{suffix}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def remove_incomplete(checkpoint_dir: Path) -> None:
    """Delete what interrupted saves and deletes left behind."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    for path in scan(checkpoint_dir).incomplete:
        log.warning("Removing %s, left by an interrupted save or delete.", path)
        shutil.rmtree(path, ignore_errors=True)
