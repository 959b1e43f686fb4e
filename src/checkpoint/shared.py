"""Whether every rank sees the checkpoint directory rank 0 sees: checked before any training.

Ranks that name different directories (a per-rank temp dir, nodes without a shared filesystem)
would otherwise fail at the first save, after a whole checkpoint interval of training is lost.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import cast

from checkpoint.errors import CheckpointDirectoryError
from gangs import Gang

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
