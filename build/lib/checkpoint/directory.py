"""The checkpoint directory on disk: what is in it, the moves that keep it consistent, a head
start for the flushes of large files, and whether every rank sees it.

``step_N/`` with a manifest is a committed checkpoint; ``step_N.tmp/`` (or a ``step_N/`` without
a manifest, left by an interrupted delete) is incomplete; ``step_N.damaged[K]/`` was found damaged
by a resume and moved aside; ``step_N.unhealthy[K]/`` was marked unhealthy and moved aside when the
run, rolled back, saved step N again. Every function here runs on one rank; the manager coordinates.

The durable writes themselves are :mod:`trainkit_utils.files`. The shared-directory
check runs before any training: ranks that name different directories (a per-rank temp dir, nodes
without a shared filesystem) would otherwise fail at the first save, after a whole checkpoint
interval of training is lost.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

from checkpoint.errors import CheckpointDirectoryError
from gangs import Gang
from trainkit_utils.files import fsync_dir

log = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"

STEP_DIR_PATTERN: Final = re.compile(r"^step_(\d+)$")
_DAMAGED_DIR = re.compile(r"^step_\d+\.damaged\d*$")
_UNHEALTHY_DIR = re.compile(r"^step_\d+\.unhealthy\d*$")


@dataclass(frozen=True)
class DirectoryListing:
    committed: dict[int, Path]
    """Step number -> directory, for every ``step_N`` with a manifest, oldest first."""
    incomplete: list[Path]
    damaged: list[Path]
    replaced: list[Path]
    """Unhealthy checkpoints moved aside by a newer save of their step."""


def step_dir(checkpoint_dir: Path, step_nr: int) -> Path:
    return checkpoint_dir / f"step_{step_nr}"


def scan(checkpoint_dir: Path) -> DirectoryListing:
    """Sort every entry of ``checkpoint_dir`` into committed, incomplete and damaged."""
    committed: dict[int, Path] = {}
    incomplete: list[Path] = []
    damaged: list[Path] = []
    replaced: list[Path] = []
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
            elif _UNHEALTHY_DIR.match(path.name):
                replaced.append(path)
    return DirectoryListing(
        committed=dict(sorted(committed.items())),
        incomplete=sorted(incomplete),
        damaged=sorted(damaged),
        replaced=sorted(replaced),
    )


def delete(path: Path) -> None:
    """Remove a checkpoint; the manifest goes first, so a crash midway leaves it invisible."""
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def move_aside(path: Path, why: str = "damaged") -> Path:
    """Rename a checkpoint to ``step_N.<why>`` (or ``.<why>K``); return the target."""
    target = path.with_name(f"{path.name}.{why}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = path.with_name(f"{path.name}.{why}{suffix}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def remove_incomplete(checkpoint_dir: Path) -> None:
    """Delete what interrupted saves and deletes left behind."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    for path in scan(checkpoint_dir).incomplete:
        log.warning("Removing %s, left by an interrupted save or delete.", path)
        shutil.rmtree(path, ignore_errors=True)


_SYNC_FILE_RANGE_WRITE: Final = 2


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


_PROBE_PREFIX = ".shared-directory-probe-"


def check_shared_directory(gang: Gang, checkpoint_dir: Path) -> None:
    """Raise :class:`CheckpointDirectoryError` on every rank unless all see rank 0's directory.

    Rank 0 writes a probe file with a random token into ``checkpoint_dir``; every rank must find
    it under the same resolved path. Three collectives of small objects; nothing on one process.
    """
    if gang.size == 1:
        return
    probe: list[object] = [None]
    if gang.rank == 0:
        probe[0] = _write_probe(checkpoint_dir)
    gang.broadcast_objects(probe)
    if isinstance(probe[0], str):  # rank 0 could not write; no rank may wait for it
        raise CheckpointDirectoryError(probe[0])
    resolved, name, token = cast(tuple[str, str, str], probe[0])
    problems = gang.all_gather_objects(_problem(checkpoint_dir, resolved, name, token))
    if gang.rank == 0:
        (checkpoint_dir / name).unlink(missing_ok=True)
    bad = [(rank, problem) for rank, problem in enumerate(problems) if problem is not None]
    if bad:
        details = "; ".join(f"rank {rank} {problem}" for rank, problem in bad)
        raise CheckpointDirectoryError(
            f"Every rank must see the checkpoint directory of rank 0 ({resolved}), but {details}. "
            "Checkpoints need a filesystem shared by all ranks: give every rank the same output "
            "directory, on storage that all nodes mount."
        )


def _problem(checkpoint_dir: Path, resolved: str, name: str, token: str) -> str | None:
    mine = os.path.realpath(checkpoint_dir)
    if mine != resolved:
        return f"uses {mine}"
    try:
        if (checkpoint_dir / name).read_text() == token:
            return None
    except OSError:
        pass
    return f"does not see the file {name} that rank 0 wrote there"


def _write_probe(checkpoint_dir: Path) -> tuple[str, str, str] | str:
    """Rank 0's probe (resolved directory, file name, token), or why it cannot write one."""
    token = secrets.token_hex(16)
    file = checkpoint_dir / f"{_PROBE_PREFIX}{token}"
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        file.write_text(token)
    except OSError as ex:
        return f"Rank 0 cannot write into the checkpoint directory {checkpoint_dir}: {ex}"
    return (str(checkpoint_dir.resolve()), file.name, token)
