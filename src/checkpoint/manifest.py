"""The manifest of a checkpoint: what it holds, and the checksums that prove it is intact.

``manifest.json`` is written last, by rank 0, into the directory before its rename: a directory
with a manifest is committed. It records the step, the score, the kind (``full``, or ``model``
once retention pruned the optimizer and trainer state), the world layout, and the size and
sha256 of every file.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Final

import torch

from checkpoint.directory import MANIFEST_NAME
from checkpoint.durable import write_json_durably
from checkpoint.errors import CheckpointError

FORMAT_VERSION: Final = 1


def make_manifest(
    step_dir: Path, *, step_nr: int, score: float | None, layout: dict[str, int]
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "step_nr": step_nr,
        "score": score,
        "kind": "full",
        **layout,
        "torch_version": torch.__version__,
        "created_at": time.time(),
        "files": checksum_files(step_dir),
    }


def read_manifest(step_dir: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    except (OSError, json.JSONDecodeError) as ex:
        raise CheckpointError(f"The manifest of {step_dir} cannot be read: {ex}") from ex
    if not isinstance(manifest, dict) or "files" not in manifest:
        raise CheckpointError(f"The manifest of {step_dir} is not a checkpoint manifest.")
    return manifest


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    write_json_durably(manifest, step_dir / MANIFEST_NAME)


def prune_manifest_to_model(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest of the same checkpoint once only its ``model/`` files are left."""
    files = {name: entry for name, entry in manifest["files"].items() if name.startswith("model/")}
    return {**manifest, "kind": "model", "files": files}


def checksum_files(root: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file below ``root``, by path relative to it."""
    return {
        file.relative_to(root).as_posix(): {"size": file.stat().st_size, "sha256": sha256_of(file)}
        for file in sorted(p for p in root.rglob("*") if p.is_file())
    }


def verify_files(step_dir: Path, manifest: dict[str, Any], step_nr: int) -> None:
    """Raise CheckpointError unless every file of ``manifest`` is there with its size and sum."""
    for name, entry in manifest["files"].items():
        file = step_dir / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint of step {step_nr}.")
        try:
            size = file.stat().st_size
            if size != entry["size"]:
                raise CheckpointError(
                    f"{file} has {size} bytes, but the manifest says {entry['size']}: it is "
                    "truncated or altered."
                )
            digest = sha256_of(file)
        except OSError as ex:
            raise CheckpointError(f"{file} cannot be read: {ex}") from ex
        if digest != entry["sha256"]:
            raise CheckpointError(f"{file} does not match its checksum: it is damaged or altered.")


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
