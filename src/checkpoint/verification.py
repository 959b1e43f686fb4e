"""Verifying a checkpoint against its manifest: on its own, or while it loads.

:func:`verify_share` reads this rank's share of the files (split by size) once, for their digests:
what :meth:`CheckpointManager.verify` and a model-only load do before anything loads.

A resume does not read any byte for its digest alone (:class:`LoadCheck`):

1. Before anything loads, each rank checks that its share of the files is there at its size (a
   ``stat`` each), so a missing, truncated or emptied file never reaches DCP.
2. DCP loads the model and optimizer. The ranks that read a file split those files between them,
   and each hashes its own as DCP reads them (:class:`~checkpoint.integrity.HashingReader`).
3. :meth:`LoadCheck.finish`: each rank compares those digests with the manifest, reads its share
   of the files no load hashed (DCP's ``.metadata``, ``trainer/rank_R.pt``), and the ranks agree
   on one verdict.

A damaged file of the same size is therefore found after it loaded: the model and optimizer may
hold its bytes when the verdict is "damaged". (A damaged file that makes the load fail is named
by a full :func:`verify_share` pass, run only then.) The manager then loads an older checkpoint into them,
which overwrites every tensor and the optimizer's state (DCP loads every entry of the state
dicts, or fails), or stops the run when no intact one is left; a damaged checkpoint's trainer
state is never returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, final

from checkpoint import directory
from checkpoint.errors import CheckpointNotFoundError
from checkpoint.integrity import ReadDigests, share_of
from checkpoint.manifest import ManifestFiles, read_manifest, verify_files


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
