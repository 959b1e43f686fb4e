"""Save, verify, list, prune and load checkpoints with an all-or-nothing commit.

A checkpoint of step N lives in ``step_N/``::

    step_N/
      model/          torch.distributed.checkpoint of the model (any DDP/FSDP2/TP layout)
      optimizer/      the same for the optimizer (absent in a model-only checkpoint)
      trainer/rank_R.pt   per-rank trainer state (step, data position, RNG, scheduler, ...)
      manifest.json   written last: files, sizes, checksums, step, score, world layout, versions

Every rank writes into ``step_N.tmp/``; once all ranks have finished, rank 0 writes the manifest
and renames the directory to ``step_N`` in one atomic step. A directory without a manifest, or
with a ``.tmp`` suffix, is never loaded and is removed when the next manager starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, final

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.nn import Module
from torch.optim import Optimizer

from checkpoint.retention import CheckpointInfo, RetentionPolicy, plan_retention
from gangs import Gangs, ReduceOperation

log = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"
FORMAT_VERSION: Final = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or a stored one is damaged or does not fit this run."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint matches the request."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    step_nr: int
    trainer_state: dict[str, Any]
    manifest: dict[str, Any]


@final
class CheckpointManager:
    """Owns one checkpoint directory; every rank of ``gangs.root`` must make the same calls."""

    def __init__(self, checkpoint_dir: Path, gangs: Gangs) -> None:
        self._dir = Path(checkpoint_dir)
        self._gangs = gangs
        self._root = gangs.root

    @property
    def checkpoint_dir(self) -> Path:
        return self._dir

    # ------------------------------------------------------------------ saving

    def save_checkpoint(
        self,
        step_nr: int,
        *,
        model: Module,
        optimizer: Optimizer,
        trainer_state: Mapping[str, Any],
        score: float | None = None,
    ) -> None:
        """Write a full checkpoint of ``step_nr`` and commit it once every rank has finished."""
        final_dir = self._step_dir(step_nr)
        tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
        if self._root.rank == 0:
            if final_dir.exists():
                raise CheckpointError(f"A checkpoint of step {step_nr} exists already: {final_dir}")
            shutil.rmtree(tmp_dir, ignore_errors=True)
            (tmp_dir / "trainer").mkdir(parents=True)
        self._root.barrier()

        model_state, optim_state = get_state_dict(model, optimizer)
        self._collective("save the model", lambda: self._dcp_save(model_state, tmp_dir / "model"))
        self._collective(
            "save the optimizer", lambda: self._dcp_save(optim_state, tmp_dir / "optimizer")
        )
        self._collective(
            "save the trainer state",
            lambda: _save_durably(dict(trainer_state), tmp_dir / "trainer" / self._rank_file()),
        )

        def commit() -> None:
            if self._root.rank != 0:
                return
            manifest = {
                "format_version": FORMAT_VERSION,
                "step_nr": step_nr,
                "score": score,
                "kind": "full",
                "world_size": self._root.size,
                "dp_size": self._gangs.dp.size,
                "tp_size": self._gangs.tp.size,
                "torch_version": torch.__version__,
                "created_at": time.time(),
                "files": _describe_files(tmp_dir),
            }
            _write_json_durably(manifest, tmp_dir / MANIFEST_NAME)
            os.replace(tmp_dir, final_dir)
            _fsync_dir(self._dir)

        self._collective("commit the checkpoint", commit)
        log.info("Checkpoint of step %d committed to %s.", step_nr, final_dir)

    # ----------------------------------------------------------------- listing

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """The committed checkpoints (those with a manifest), oldest first."""
        infos: list[CheckpointInfo] = []
        if not self._dir.is_dir():
            return infos
        for path in self._dir.iterdir():
            match = _STEP_DIR.match(path.name)
            if match is None or not (path / MANIFEST_NAME).is_file():
                continue
            manifest = _read_manifest(path)
            infos.append(
                CheckpointInfo(
                    step_nr=int(match.group(1)),
                    score=manifest.get("score"),
                    kind=manifest.get("kind", "full"),
                    size_bytes=sum(f["size"] for f in manifest.get("files", {}).values()),
                )
            )
        return sorted(infos, key=lambda info: info.step_nr)

    def last_step_nr(self, *, kind: Literal["full", "any"] = "full") -> int | None:
        steps = [i.step_nr for i in self.list_checkpoints() if kind == "any" or i.kind == "full"]
        return steps[-1] if steps else None

    # ----------------------------------------------------------------- loading

    def load_last_checkpoint(
        self, *, model: Module, optimizer: Optimizer
    ) -> LoadedCheckpoint | None:
        """Load the newest intact full checkpoint into ``model`` and ``optimizer``.

        A damaged checkpoint is skipped with a warning in favour of the one before it. Returns
        ``None`` when there is no checkpoint to resume from.
        """
        candidates = [i.step_nr for i in self.list_checkpoints() if i.kind == "full"]
        for step_nr in reversed(candidates):
            try:
                return self.load_checkpoint(step_nr, model=model, optimizer=optimizer)
            except CheckpointError as ex:
                log.warning("Skipping the checkpoint of step %d: %s", step_nr, ex)
        if candidates:
            raise CheckpointError(
                f"None of the checkpoints in {self._dir} (steps {candidates}) is intact. "
                "Move the directory away to start from scratch."
            )
        return None

    def load_checkpoint(
        self, step_nr: int, *, model: Module, optimizer: Optimizer
    ) -> LoadedCheckpoint:
        """Verify and load the full checkpoint of ``step_nr``; raise CheckpointError if damaged."""
        path = self._step_dir(step_nr)
        manifest = self._verified_manifest(path, step_nr)
        if manifest["kind"] != "full":
            raise CheckpointError(
                f"The checkpoint of step {step_nr} holds only the model (its optimizer and "
                "trainer state were pruned by retention), so training cannot resume from it."
            )
        self._check_layout(manifest)

        model_state, optim_state = get_state_dict(model, optimizer)
        self._collective(
            "load the model",
            lambda: self._dcp_load(model_state, path / "model"),
        )
        self._collective(
            "load the optimizer",
            lambda: self._dcp_load(optim_state, path / "optimizer"),
        )
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)

        trainer_file = path / "trainer" / self._rank_file()
        trainer_state = self._collective(
            "load the trainer state", lambda: torch.load(trainer_file, weights_only=True)
        )
        log.info("Loaded the checkpoint of step %d from %s.", step_nr, path)
        return LoadedCheckpoint(step_nr=step_nr, trainer_state=trainer_state, manifest=manifest)

    def load_model(self, step_nr: int, *, model: Module) -> None:
        """Load only the model of the checkpoint of ``step_nr`` (full or model-only)."""
        path = self._step_dir(step_nr)
        self._verified_manifest(path, step_nr)
        state = get_model_state_dict(model)
        self._collective(
            "load the model",
            lambda: self._dcp_load(state, path / "model"),
        )
        set_model_state_dict(model, state)

    # --------------------------------------------------------------- retention

    def apply_retention(self, policy: RetentionPolicy) -> None:
        """Delete or prune to model-only what ``policy`` does not keep; committed ones only."""
        if self._root.rank == 0:
            plan = plan_retention(self.list_checkpoints(), policy)
            for step_nr in plan.prune_to_model:
                self._prune_to_model(step_nr)
            for step_nr in plan.delete:
                self.delete_checkpoint(step_nr)
        self._root.barrier()

    def delete_checkpoint(self, step_nr: int) -> None:
        """Remove a checkpoint; the manifest goes first, so a crash midway leaves it invisible."""
        path = self._step_dir(step_nr)
        (path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        log.info("Deleted the checkpoint of step %d.", step_nr)

    def _prune_to_model(self, step_nr: int) -> None:
        path = self._step_dir(step_nr)
        manifest = _read_manifest(path)
        manifest["kind"] = "model"
        manifest["files"] = {
            name: entry for name, entry in manifest["files"].items() if name.startswith("model/")
        }
        # The smaller manifest is valid before anything is removed, so no crash leaves a lie.
        _write_json_durably(manifest, path / MANIFEST_NAME)
        shutil.rmtree(path / "optimizer", ignore_errors=True)
        shutil.rmtree(path / "trainer", ignore_errors=True)
        log.info("Pruned the checkpoint of step %d to its model.", step_nr)

    # ----------------------------------------------------------------- helpers

    def verify(self, step_nr: int) -> dict[str, Any]:
        """Check sizes and checksums of the checkpoint of ``step_nr``; return its manifest."""
        path = self._step_dir(step_nr)
        if not (path / MANIFEST_NAME).is_file():
            raise CheckpointNotFoundError(
                f"There is no committed checkpoint of step {step_nr} in {self._dir}."
            )
        manifest = _read_manifest(path)
        for name, entry in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing from the checkpoint of step {step_nr}.")
            size = file.stat().st_size
            if size != entry["size"]:
                raise CheckpointError(
                    f"{file} has {size} bytes, but the manifest says {entry['size']}: it is truncated or altered."
                )
            if _sha256(file) != entry["sha256"]:
                raise CheckpointError(
                    f"{file} does not match its checksum: it is damaged or altered."
                )
        return manifest

    def _verified_manifest(self, path: Path, step_nr: int) -> dict[str, Any]:
        # Rank 0 reads every byte once; the others learn the verdict.
        verdict: list[Any] = [None]
        if self._root.rank == 0:
            try:
                verdict[0] = ("ok", self.verify(step_nr))
            except CheckpointError as ex:
                verdict[0] = ("error", str(ex))
        self._root.broadcast_objects(verdict)
        status, payload = verdict[0]
        if status != "ok":
            raise CheckpointError(payload)
        return dict(payload)

    def _check_layout(self, manifest: Mapping[str, Any]) -> None:
        saved, now = manifest["world_size"], self._root.size
        if saved != now:
            raise CheckpointError(
                f"The checkpoint of step {manifest['step_nr']} was saved by {saved} processes, "
                f"but this run has {now}. Its data position and per-rank state cannot be resharded: "
                f"resume with {saved} processes, or load only its model "
                "(CheckpointManager.load_model) to start a new run from it."
            )

    def _collective(self, what: str, action: Callable[[], T]) -> T:
        """Run ``action`` on every rank; if it fails on any rank, raise on every rank."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = action()
        except Exception as ex:
            error = ex
        failed = torch.tensor([0.0 if error is None else 1.0])
        self._root.all_reduce(failed, ReduceOperation.MAX)
        if failed.item() > 0:
            if error is not None:
                raise CheckpointError(
                    f"Failed to {what} on rank {self._root.rank}: {error}"
                ) from error
            raise CheckpointError(f"Failed to {what} on another rank; see that rank's log.")
        return result  # type: ignore[no-any-return]

    def _dcp_save(self, state: dict[str, Any], path: Path) -> None:
        if self._root.size == 1:
            with _single_process_dcp():
                dcp_save(state, checkpoint_id=path, no_dist=True)
        else:
            dcp_save(state, checkpoint_id=path, process_group=self._root.as_process_group())

    def _dcp_load(self, state: dict[str, Any], path: Path) -> None:
        if self._root.size == 1:
            with _single_process_dcp():
                dcp_load(state, checkpoint_id=path, no_dist=True)
        else:
            dcp_load(state, checkpoint_id=path, process_group=self._root.as_process_group())

    def _rank_file(self) -> str:
        return f"rank_{self._root.rank}.pt"

    def _step_dir(self, step_nr: int) -> Path:
        return self._dir / f"step_{step_nr}"

    def remove_leftovers(self) -> None:
        """Delete what interrupted saves and deletes left behind; every rank must call it.

        Only a run that owns the directory may call it: a save in progress looks the same.
        """
        if self._root.rank == 0:
            self._dir.mkdir(parents=True, exist_ok=True)
            for path in self.incomplete_dirs():
                log.warning("Removing %s, left by an interrupted save or delete.", path)
                shutil.rmtree(path, ignore_errors=True)
        self._root.barrier()

    def incomplete_dirs(self) -> list[Path]:
        """Directories of saves that never committed (or deletes that never finished)."""
        if not self._dir.is_dir():
            return []
        return sorted(
            path
            for path in self._dir.iterdir()
            if path.name.endswith(".tmp")
            or (_STEP_DIR.match(path.name) and not (path / MANIFEST_NAME).is_file())
        )


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    # DCP warns that it "assumes" a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _describe_files(root: Path) -> dict[str, dict[str, Any]]:
    files = {}
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        files[file.relative_to(root).as_posix()] = {
            "size": file.stat().st_size,
            "sha256": _sha256(file),
        }
    return files


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, json.JSONDecodeError) as ex:
        raise CheckpointError(f"The manifest of {path} cannot be read: {ex}") from ex
    if not isinstance(manifest, dict) or "files" not in manifest:
        raise CheckpointError(f"The manifest of {path} is not a checkpoint manifest.")
    return manifest


def _save_durably(obj: Any, file: Path) -> None:
    with file.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json_durably(obj: Any, file: Path) -> None:
    tmp = file.with_name(file.name + ".partial")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    _fsync_dir(file.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
