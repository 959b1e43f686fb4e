"""The manifest of a checkpoint, verifying a checkpoint against it, and listing and choosing
the committed checkpoints of a directory by their manifests.

``manifest.json`` is written last, by rank 0, into the directory before its rename: a directory
with a manifest is committed. It records the step, the score, the kind (``full``, or ``model``
once retention pruned the optimizer and trainer state), the world layout, and the size and
digest of every file. The format is version 2 (``FORMAT_VERSION``): it names its digest
``algorithm`` (xxh3-128) and stores each file's as ``digest``. A manifest of any other version
is refused with a clear error; a change to its entries bumps the version.

Verifying: :func:`verify_share` reads this rank's share of the files (split by size) once, for
their digests: what :meth:`CheckpointManager.verify` and a model-only load do before anything
loads. A resume does not read any byte for its digest alone (:class:`LoadCheck`):

1. Before anything loads, each rank checks that its share of the files is there at its size (a
   ``stat`` each), so a missing, truncated or emptied file never reaches DCP.
2. DCP loads the model and optimizer. On the fast path (see :mod:`checkpoint.dcp_io`) the ranks
   that read a file split those files between them, and each hashes its own as DCP reads them
   (:class:`~checkpoint.integrity.HashingReader`).
3. :meth:`LoadCheck.finish`: each rank compares those digests with the manifest, reads its share
   of the files no load hashed (DCP's ``.metadata``, ``trainer/rank_R.pt``, and on the public
   path every file), and the ranks agree on one verdict.

A damaged file of the same size is therefore found after it loaded: the model and optimizer may
hold its bytes when the verdict is "damaged". (A damaged file that makes the load fail is named
by a full :func:`verify_share` pass, run only then.) The manager then loads an older checkpoint
into them, which overwrites every tensor and the optimizer's state (DCP loads every entry of
the state dicts, or fails), or stops the run when no intact one is left; a damaged checkpoint's
trainer state is never returned.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, final

import torch

from checkpoint import directory
from checkpoint.directory import MANIFEST_NAME
from checkpoint.errors import CheckpointError, CheckpointNotFoundError
from checkpoint.health import PERMANENT_MARK, is_marked, unhealthy_reason
from checkpoint.integrity import (
    ALGORITHM,
    FileDigest,
    ReadDigests,
    check_digest,
    check_size,
    share_of,
    verify_file,
)
from checkpoint.retention import CheckpointInfo, best_checkpoint
from trainkit_utils.files import write_json_durably

FORMAT_VERSION: Final = 2


def make_manifest(
    files: Mapping[str, FileDigest],
    *,
    step_nr: int,
    score: float | None,
    layout: dict[str, int],
    excluded: Sequence[str] = (),
) -> dict[str, Any]:
    """The manifest of a checkpoint whose ranks wrote ``files`` (by path below its directory);
    ``excluded`` lists the model entries left out of it."""
    return {
        "format_version": FORMAT_VERSION,
        "algorithm": ALGORITHM,
        "step_nr": step_nr,
        "score": score,
        "kind": "full",
        **layout,
        "torch_version": torch.__version__,
        "created_at": time.time(),
        "excluded": list(excluded),
        "files": {name: files[name].as_entry() for name in sorted(files)},
    }


def read_manifest(step_dir: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as ex:
        raise CheckpointError(f"The manifest of {step_dir} cannot be read: {ex}") from ex
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"The manifest of {step_dir} is not a checkpoint manifest.")
    return manifest


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    write_json_durably(manifest, step_dir / MANIFEST_NAME)


def prune_manifest_to_model(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest of the same checkpoint once only its ``model/`` files are left."""
    files = {name: entry for name, entry in manifest["files"].items() if name.startswith("model/")}
    return {**manifest, "kind": "model", "files": files}


def prune_to_model(step_dir: Path) -> None:
    """Remove all but the model of the checkpoint in ``step_dir``, and say so in its manifest.

    The smaller manifest is valid before anything is removed, so no crash leaves a lie.
    """
    write_manifest(step_dir, prune_manifest_to_model(read_manifest(step_dir)))
    shutil.rmtree(step_dir / "optimizer", ignore_errors=True)
    shutil.rmtree(step_dir / "trainer", ignore_errors=True)


def verify_files(
    step_dir: Path, manifest: dict[str, Any], step_nr: int, *, rank: int = 0, world_size: int = 1
) -> int:
    """Raise CheckpointError unless ``rank``'s share of the files of ``manifest`` is intact.

    The files are split by size between ``world_size`` ranks (all of them for one), and each is
    read once. Returns the number of bytes this rank checked.
    """
    entries = ManifestFiles.of(step_dir, manifest)
    share = share_of(entries.sizes, rank=rank, world_size=world_size)
    entries.check_present(share, step_nr)
    for name in share:
        entries.verify(name)
    return sum(entries.sizes[name] for name in share)


@final
@dataclass(frozen=True)
class ManifestFiles:
    """The files a manifest lists, with the size and digest of each."""

    step_dir: Path
    algorithm: str
    sizes: dict[str, int]
    digests: dict[str, str]

    @staticmethod
    def of(step_dir: Path, manifest: dict[str, Any]) -> ManifestFiles:
        algorithm = _digest_algorithm(manifest, step_dir)
        try:
            sizes = {name: int(entry["size"]) for name, entry in manifest["files"].items()}
            digests = {name: str(entry["digest"]) for name, entry in manifest["files"].items()}
        except (KeyError, TypeError, ValueError) as ex:
            raise CheckpointError(
                f"The manifest of {step_dir} has a malformed file entry: {ex}"
            ) from ex
        return ManifestFiles(step_dir, algorithm, sizes, digests)

    def check_present(self, names: Iterable[str], step_nr: int) -> None:
        """Raise CheckpointError unless the files ``names`` are in the checkpoint, at their size."""
        for name in names:
            file = self.step_dir / name
            if not file.resolve().is_relative_to(self.step_dir.resolve()):
                raise CheckpointError(
                    f"The manifest of {self.step_dir} names a file outside it: {name}"
                )
            if not file.is_file():
                raise CheckpointError(f"{file} is missing from the checkpoint of step {step_nr}.")
            check_size(file, self.sizes[name])

    def verify(self, name: str) -> None:
        """Read the file ``name`` once and raise CheckpointError unless its digest matches."""
        verify_file(
            self.step_dir / name,
            size=self.sizes[name],
            digest=self.digests[name],
            algorithm=self.algorithm,
        )

    def check(self, name: str, actual: FileDigest) -> None:
        """Raise CheckpointError unless ``actual``, taken of the file ``name``, matches."""
        if name not in self.sizes:
            raise CheckpointError(
                f"{self.step_dir / name} is not in the manifest of {self.step_dir}: the "
                "checkpoint's DCP metadata names a file that is not one of its own."
            )
        check_digest(
            self.step_dir / name,
            actual,
            size=self.sizes[name],
            digest=self.digests[name],
            algorithm=self.algorithm,
        )


def _digest_algorithm(manifest: dict[str, Any], step_dir: Path) -> str:
    version = manifest.get("format_version")
    if version == FORMAT_VERSION:
        return str(manifest.get("algorithm"))
    raise CheckpointError(
        f"The manifest of {step_dir} has format_version {version!r}, but this version of the "
        f"project reads {FORMAT_VERSION} only: load the checkpoint with the version that wrote it."
    )


def read_committed_manifest(step_dir: Path, step_nr: int) -> dict[str, Any]:
    """The manifest of the committed checkpoint in ``step_dir``; CheckpointError if unreadable."""
    if not (step_dir / directory.MANIFEST_NAME).is_file():
        raise CheckpointNotFoundError(
            f"There is no committed checkpoint of step {step_nr} in {step_dir.parent}."
        )
    return read_manifest(step_dir)


def verify_share(step_dir: Path, step_nr: int, *, rank: int, world_size: int) -> dict[str, Any]:
    """Read ``rank``'s share of the files once and check their digests; return the manifest."""
    manifest = read_committed_manifest(step_dir, step_nr)
    verify_files(step_dir, manifest, step_nr, rank=rank, world_size=world_size)
    return manifest


@final
class LoadCheck:
    """The verification of one checkpoint, spread over its load (see the module docstring).

    Every rank makes one, calls :meth:`reads` for each DCP directory it loads (in the same order
    on every rank), and calls :meth:`finish` once everything has loaded.
    """

    def __init__(self, step_dir: Path, step_nr: int, *, rank: int, world_size: int) -> None:
        """Read the manifest and check that this rank's share of the files is there in full."""
        self.manifest = read_committed_manifest(step_dir, step_nr)
        self._files = ManifestFiles.of(step_dir, self.manifest)
        self._rank = rank
        self._world_size = world_size
        self._reads: dict[str, ReadDigests] = {}
        self._files.check_present(self._share(self._files.sizes), step_nr)

    def reads(self, subdir: str) -> ReadDigests:
        """Where the load of the DCP directory ``subdir`` puts the digests it takes."""
        self._reads[subdir] = ReadDigests(self._files.algorithm)
        return self._reads[subdir]

    @property
    def reread(self) -> int:
        """Bytes this rank read a second time for the digests of the loads (headers DCP skips)."""
        return sum(digests.reread for digests in self._reads.values())

    def finish(self) -> int:
        """Raise CheckpointError unless every digest this rank took or reads now matches.

        Returns the number of bytes this rank read for the digests of the files no load hashed.
        """
        covered: set[str] = set()
        for subdir, digests in self._reads.items():
            covered.update(f"{subdir}/{name}" for name in digests.covered)
            for name, actual in sorted(digests.hashed.items()):
                self._files.check(f"{subdir}/{name}", actual)
        rest = {name: size for name, size in self._files.sizes.items() if name not in covered}
        share = self._share(rest)
        for name in share:
            self._files.verify(name)
        return sum(rest[name] for name in share)

    def _share(self, sizes: dict[str, int]) -> list[str]:
        return share_of(sizes, rank=self._rank, world_size=self._world_size)


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
                healthy=unhealthy_reason(path) is None,
                permanent=is_marked(path, PERMANENT_MARK),
            )
        )
    return infos


def resume_candidates(checkpoint_dir: Path) -> list[int]:
    """Committed healthy steps that may hold a full checkpoint, oldest first.

    An unreadable manifest counts: verification will call that checkpoint damaged, with the reason.
    """
    steps = []
    for step_nr, path in directory.scan(checkpoint_dir).committed.items():
        if unhealthy_reason(path) is not None:
            continue
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

    ``which`` is ``"last"`` (the newest healthy one), ``"best"`` (the healthy one with the best
    score stored with it, oriented by ``lower_better``; ties go to the newer one) or a step
    number (any committed checkpoint, an unhealthy one too: asked for by name).
    """
    check_choice(which)
    if not infos:
        raise CheckpointNotFoundError(f"There are no committed checkpoints in {where}.")
    if which in ("last", "best") and not any(info.healthy for info in infos):
        raise CheckpointNotFoundError(
            f"Every checkpoint in {where} (steps {', '.join(str(i.step_nr) for i in infos)}) is "
            f"marked unhealthy, so none is the {which}. Name one by its step to use it anyway."
        )
    if which == "last":
        return max(info.step_nr for info in infos if info.healthy)
    if which == "best":
        best = best_checkpoint(infos, lower_better=lower_better)
        if best is None:
            raise CheckpointNotFoundError(
                f"No healthy checkpoint in {where} has a validation score, so none is the best."
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
