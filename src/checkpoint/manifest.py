"""The manifest of a checkpoint: what it holds, and the digests that prove it is intact.

``manifest.json`` is written last, by rank 0, into the directory before its rename: a directory
with a manifest is committed. It records the step, the score, the kind (``full``, or ``model``
once retention pruned the optimizer and trainer state), the world layout, and the size and
digest of every file. Format 2 names its digest ``algorithm`` (xxh3-128) and stores each file's
as ``digest``; format 1 stored sha256 sums as ``sha256``, and still verifies.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, final

import torch

from checkpoint.directory import MANIFEST_NAME
from checkpoint.durable import write_json_durably
from checkpoint.errors import CheckpointError
from checkpoint.integrity import (
    ALGORITHM,
    FileDigest,
    check_digest,
    check_size,
    share_of,
    verify_file,
)

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
        algorithm, digest_key = _digest_scheme(manifest, step_dir)
        try:
            sizes = {name: int(entry["size"]) for name, entry in manifest["files"].items()}
            digests = {name: str(entry[digest_key]) for name, entry in manifest["files"].items()}
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


def _digest_scheme(manifest: dict[str, Any], step_dir: Path) -> tuple[str, str]:
    version = manifest.get("format_version")
    if version == 1:
        return "sha256", "sha256"
    if version == FORMAT_VERSION:
        return str(manifest.get("algorithm")), "digest"
    raise CheckpointError(
        f"The manifest of {step_dir} has format_version {version!r}, but this version of the "
        f"project reads 1 and {FORMAT_VERSION}: upgrade it to load this checkpoint."
    )
