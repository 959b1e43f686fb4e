"""The committed checkpoints of a directory, as their manifests describe them, and choosing one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from checkpoint import directory
from checkpoint.errors import CheckpointError, CheckpointNotFoundError
from checkpoint.manifest import read_manifest
from checkpoint.retention import CheckpointInfo, best_checkpoint

log = logging.getLogger(__name__)

CheckpointChoice = Literal["last", "best"] | int
"""A committed checkpoint by name: the last, the best scored, or the one of a step."""


def list_checkpoints(checkpoint_dir: Path) -> list[CheckpointInfo]:
    """The committed checkpoints (those with a readable manifest), oldest first."""
    infos: list[CheckpointInfo] = []
    for step_nr, path in directory.scan(checkpoint_dir).committed.items():
        try:
            manifest = read_manifest(path)
        except CheckpointError as ex:
            log.warning("Ignoring %s: %s", path, ex)
            continue
        infos.append(
            CheckpointInfo(
                step_nr=step_nr,
                score=manifest.get("score"),
                kind=manifest.get("kind", "full"),
                size_bytes=sum(f["size"] for f in manifest.get("files", {}).values()),
            )
        )
    return infos


def resume_candidates(checkpoint_dir: Path) -> list[int]:
    """Committed steps that may hold a full checkpoint, oldest first.

    An unreadable manifest counts: verification will call that checkpoint damaged, with the reason.
    """
    steps = []
    for step_nr, path in directory.scan(checkpoint_dir).committed.items():
        try:
            kind = read_manifest(path).get("kind", "full")
        except CheckpointError:
            kind = "full"
        if kind == "full":
            steps.append(step_nr)
    return steps


def select_checkpoint(checkpoint_dir: Path, which: CheckpointChoice, *, lower_better: bool) -> int:
    """The step of the committed checkpoint in ``checkpoint_dir`` that ``which`` names (see
    :func:`choose_checkpoint`)."""
    infos = list_checkpoints(checkpoint_dir)
    return choose_checkpoint(infos, which, lower_better=lower_better, where=str(checkpoint_dir))


def check_choice(which: CheckpointChoice) -> None:
    if not (which in ("last", "best") or (isinstance(which, int) and which >= 0)):
        raise ValueError(
            f"which must be 'last', 'best' or a step number, but is {which!r} instead."
        )


def choose_checkpoint(
    infos: Sequence[CheckpointInfo], which: CheckpointChoice, *, lower_better: bool, where: str
) -> int:
    """The step of the checkpoint among ``infos`` (of ``where``) that ``which`` names;
    CheckpointNotFoundError if none.

    ``which`` is ``"last"``, ``"best"`` (by the score stored with each checkpoint, oriented by
    ``lower_better``; ties go to the newer one) or a step number.
    """
    check_choice(which)
    if not infos:
        raise CheckpointNotFoundError(f"There are no committed checkpoints in {where}.")
    if which == "last":
        return infos[-1].step_nr
    if which == "best":
        best = best_checkpoint(infos, lower_better=lower_better)
        if best is None:
            raise CheckpointNotFoundError(
                f"No checkpoint in {where} has a validation score, so none is the best."
            )
        return best.step_nr
    assert isinstance(which, int)
    if which not in {info.step_nr for info in infos}:
        raise CheckpointNotFoundError(
            f"There is no committed checkpoint of step {which} in {where}; "
            f"the steps there are {', '.join(str(i.step_nr) for i in infos)}."
        )
    return which


def resolve_step_dir(path: Path) -> tuple[Path, int]:
    """The checkpoint directory and step of ``path``, a committed full ``step_N`` directory of
    any run; ValueError naming the problem otherwise."""
    match = directory.STEP_DIR_PATTERN.match(path.name)
    if not path.exists():
        raise ValueError(
            f"resume_from is {path}, which does not exist. Pass the step_N directory of a "
            "checkpoint, e.g. OTHER_OUTPUT_DIR/checkpoints/step_1000."
        )
    if match is None or not path.is_dir():
        raise ValueError(
            f"resume_from is {path}, which is not a step_N checkpoint directory. Pass one of "
            "the step_N directories inside a run's checkpoints/ directory."
        )
    if not (path / directory.MANIFEST_NAME).is_file():
        raise ValueError(
            f"resume_from is {path}, which has no {directory.MANIFEST_NAME}: the save of that "
            "checkpoint never committed (or its delete never finished). Pick a complete one."
        )
    try:
        kind = read_manifest(path).get("kind", "full")
    except CheckpointError as ex:
        raise ValueError(f"resume_from is {path}, which cannot be resumed from: {ex}") from ex
    if kind != "full":
        raise ValueError(
            f"resume_from is {path}, which holds only the model (retention pruned its optimizer "
            "and trainer state), so a run cannot resume from it. Pass it as init_from to start "
            "from its weights, or pick a full checkpoint."
        )
    return path.parent, int(match.group(1))
