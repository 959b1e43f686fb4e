"""Marks on a committed checkpoint, each a small file beside its manifest: ``unhealthy.json``
(saved while a loss spike was building up: never resumed from, never the last or the best) and
``permanent.json`` (a snapshot that retention never deletes).

A mark is written durably in one step (a temporary file, fsynced, then renamed), so a crash
leaves the checkpoint marked or not, never half marked; the manifest and the digested files are
never touched, so a mark cannot damage a checkpoint. Marking again keeps the first mark.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from checkpoint import directory
from checkpoint.errors import CheckpointError, CheckpointNotFoundError
from checkpoint.retention import RetentionPolicy
from trainkit_utils.files import write_json_durably

log = logging.getLogger(__name__)

UNHEALTHY_MARK: Final = "unhealthy.json"
PERMANENT_MARK: Final = "permanent.json"


def mark(step_dir: Path, name: str, **details: Any) -> bool:
    """Write the mark ``name`` with ``details`` into ``step_dir``; False if it was there already."""
    if (step_dir / name).is_file():
        return False
    write_json_durably({**details, "marked_at": time.time()}, step_dir / name)
    return True


def is_marked(step_dir: Path, name: str) -> bool:
    return (step_dir / name).is_file()


def unhealthy_reason(step_dir: Path) -> str | None:
    """Why the checkpoint in ``step_dir`` is unhealthy; None if it is healthy.

    A mark that cannot be read still marks it: the rename made it whole, so only a damaged disk
    can garble it, and such a checkpoint is no rollback target either.
    """
    file = step_dir / UNHEALTHY_MARK
    if not file.is_file():
        return None
    try:
        return str(json.loads(file.read_text())["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"marked unhealthy ({file.name} is unreadable)"


def mark_unhealthy(checkpoint_dir: Path, step_nrs: Sequence[int], *, reason: str) -> None:
    """Mark the committed checkpoints of ``step_nrs`` in ``checkpoint_dir`` unhealthy; none if
    one of them is missing (:class:`CheckpointNotFoundError`)."""
    committed = directory.scan(checkpoint_dir).committed
    missing = sorted(set(step_nrs) - set(committed))
    if missing:
        raise CheckpointNotFoundError(
            f"Cannot mark steps {missing} unhealthy: there is no committed checkpoint of them in "
            f"{checkpoint_dir} (the steps there are {list(committed)})."
        )
    for step_nr in sorted(set(step_nrs)):
        if mark(committed[step_nr], UNHEALTHY_MARK, reason=reason):
            log.warning("Marked the checkpoint of step %d unhealthy: %s", step_nr, reason)


def mark_permanent(checkpoint_dir: Path, policy: RetentionPolicy) -> None:
    """Mark the committed checkpoints that ``policy`` makes permanent snapshots, so that they
    stay permanent under any later policy (a resume with other retention settings)."""
    for step_nr, path in directory.scan(checkpoint_dir).committed.items():
        if policy.is_permanent(step_nr):
            mark(path, PERMANENT_MARK, every=policy.keep_checkpoint_every_n_steps)


def check_not_all_unhealthy(checkpoint_dir: Path) -> None:
    """Raise CheckpointError if ``checkpoint_dir`` holds unhealthy checkpoints (and, as the
    caller found, no healthy full one): a resume must not take that for a fresh start."""
    committed = directory.scan(checkpoint_dir).committed
    unhealthy = [step for step, path in committed.items() if unhealthy_reason(path) is not None]
    if unhealthy:
        raise CheckpointError(
            f"The checkpoints in {checkpoint_dir} of steps {unhealthy} are marked unhealthy, and "
            "there is no healthy full one to resume from. Move the directory away to start from scratch, "
            "or pass one of them as resume_from (in a new OUTPUT_DIR) to go on from it anyway."
        )


def log_passed_over(checkpoint_dir: Path, step_nr: int) -> None:
    """Say which unhealthy checkpoints newer than ``step_nr``, the one resumed from, were passed
    over."""
    committed = directory.scan(checkpoint_dir).committed
    newer = [
        s for s, path in committed.items() if s > step_nr and unhealthy_reason(path) is not None
    ]
    if newer:
        log.warning(
            "Resumed from the checkpoint of step %d, passing over the newer ones of steps %s: "
            "they are marked unhealthy.",
            step_nr,
            newer,
        )


def move_aside_if_unhealthy(step_dir: Path) -> None:
    """Rename an unhealthy ``step_N`` to ``step_N.unhealthy`` (kept, never loaded), so that a
    rolled-back run can commit step N again."""
    if unhealthy_reason(step_dir) is not None:
        target = directory.move_aside(step_dir, "unhealthy")
        log.warning("Moved the unhealthy checkpoint %s aside to %s.", step_dir, target)
