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

With ``async_checkpoint=True`` the model and optimizer are staged (copied to CPU memory) while the
caller waits, then written by background threads over a process group of their own; the commit
happens in :meth:`CheckpointManager.finish_pending_save`, once every rank's write is durable. Until
then the checkpoint is only a ``.tmp`` directory, so a crash loses it but never exposes it.

A committed checkpoint that fails verification when the run resumes is skipped in favour of the
one before it and renamed to ``step_N.damaged`` (kept for inspection, never loaded), so that the
resumed run can write ``step_N`` again.
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
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, final

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.nn import Module
from torch.optim import Optimizer

from checkpoint.retention import (
    CheckpointInfo,
    RetentionPolicy,
    best_checkpoint,
    plan_retention,
)
from gangs import Gangs, ReduceOperation

log = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"
FORMAT_VERSION: Final = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_DAMAGED_DIR = re.compile(r"^step_\d+\.damaged\d*$")

T = TypeVar("T")


CheckpointChoice = Literal["last", "best"] | int
"""A committed checkpoint by name: the last, the best scored, or the one of a step."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or a stored one is damaged or does not fit this run."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint matches the request."""


class CheckpointLayoutError(CheckpointError):
    """An intact checkpoint was saved by another world layout (world, DP or TP size)."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    step_nr: int
    trainer_state: dict[str, Any]
    manifest: dict[str, Any]
    resharded: bool = False
    """Saved by another world layout; ``trainer_state`` is rank 0's."""


@final
@dataclass
class _PendingSave:
    """An asynchronous save whose files are still being written; committed by its manager."""

    step_nr: int
    tmp_dir: Path
    final_dir: Path
    score: float | None
    uploads: list[Future[Any]] = field(default_factory=list)


@final
class CheckpointManager:
    """Owns one checkpoint directory; every rank of ``gangs.root`` must make the same calls."""

    def __init__(self, checkpoint_dir: Path, gangs: Gangs) -> None:
        self._dir = Path(checkpoint_dir)
        self._gangs = gangs
        self._root = gangs.root
        self._pending: _PendingSave | None = None
        self._async_groups: tuple[ProcessGroup, ProcessGroup] | None = None

    @property
    def checkpoint_dir(self) -> Path:
        return self._dir

    @property
    def pending_step_nr(self) -> int | None:
        """The step of an asynchronous save not committed yet, if there is one."""
        return None if self._pending is None else self._pending.step_nr

    # ------------------------------------------------------------------ saving

    def save_checkpoint(
        self,
        step_nr: int,
        *,
        model: Module,
        optimizer: Optimizer,
        trainer_state: Mapping[str, Any],
        score: float | None = None,
        async_checkpoint: bool = False,
    ) -> None:
        """Write a full checkpoint of ``step_nr`` and commit it once every rank has finished.

        With ``async_checkpoint`` this returns once the model and optimizer are staged in CPU
        memory; they are written in the background and committed by :meth:`finish_pending_save`
        (which the next save calls first, if the caller has not).
        """
        self.finish_pending_save()
        final_dir = self._step_dir(step_nr)
        tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
        if self._root.rank == 0:
            if final_dir.exists():
                raise CheckpointError(f"A checkpoint of step {step_nr} exists already: {final_dir}")
            shutil.rmtree(tmp_dir, ignore_errors=True)
            (tmp_dir / "trainer").mkdir(parents=True)
        self._root.barrier()

        model_state, optim_state = get_state_dict(model, optimizer)
        pending = _PendingSave(step_nr, tmp_dir, final_dir, score)
        if async_checkpoint:
            groups = self._get_async_groups()
            self._collective(
                "stage the model and optimizer",
                lambda: pending.uploads.extend(
                    [
                        self._dcp_async_save(model_state, tmp_dir / "model", groups[0]),
                        self._dcp_async_save(optim_state, tmp_dir / "optimizer", groups[1]),
                    ]
                ),
            )
        else:
            self._collective(
                "save the model", lambda: self._dcp_save(model_state, tmp_dir / "model")
            )
            self._collective(
                "save the optimizer", lambda: self._dcp_save(optim_state, tmp_dir / "optimizer")
            )
        self._collective(
            "save the trainer state",
            lambda: _save_durably(dict(trainer_state), tmp_dir / "trainer" / self._rank_file()),
        )
        if async_checkpoint:
            self._pending = pending
            log.info("Checkpoint of step %d staged; writing it in the background.", step_nr)
        else:
            self._commit(pending)

    def finish_pending_save(self) -> int | None:
        """Wait for the asynchronous save in flight, if any, and commit it; return its step.

        Every rank must call it. If the write failed on any rank, the checkpoint stays an
        invisible ``.tmp`` directory and this raises :class:`CheckpointError` on every rank.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self._collective(
            f"write the checkpoint of step {pending.step_nr}",
            lambda: [upload.result() for upload in pending.uploads],
        )
        self._commit(pending)
        return pending.step_nr

    def _commit(self, pending: _PendingSave) -> None:
        step_nr, tmp_dir, final_dir = pending.step_nr, pending.tmp_dir, pending.final_dir

        def commit() -> None:
            if self._root.rank != 0:
                return
            manifest = {
                "format_version": FORMAT_VERSION,
                "step_nr": step_nr,
                "score": pending.score,
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
            try:
                manifest = _read_manifest(path)
            except CheckpointError as ex:
                log.warning("Ignoring %s: %s", path, ex)
                continue
            infos.append(
                CheckpointInfo(
                    step_nr=int(match.group(1)),
                    score=manifest.get("score"),
                    kind=manifest.get("kind", "full"),
                    size_bytes=sum(f["size"] for f in manifest.get("files", {}).values()),
                )
            )
        return sorted(infos, key=lambda info: info.step_nr)

    def select_checkpoint(self, which: CheckpointChoice, *, lower_better: bool) -> int:
        """The step of the committed checkpoint ``which`` names; CheckpointNotFoundError if none.

        ``which`` is ``"last"``, ``"best"`` (by the score stored with each checkpoint, oriented by
        ``lower_better``; ties go to the newer one) or a step number.
        """
        if not (which in ("last", "best") or (isinstance(which, int) and which >= 0)):
            raise ValueError(
                f"which must be 'last', 'best' or a step number, but is {which!r} instead."
            )
        infos = self.list_checkpoints()
        if not infos:
            raise CheckpointNotFoundError(f"There are no committed checkpoints in {self._dir}.")
        if which == "last":
            return infos[-1].step_nr
        if which == "best":
            best = best_checkpoint(infos, lower_better=lower_better)
            if best is None:
                raise CheckpointNotFoundError(
                    f"No checkpoint in {self._dir} has a validation score, so none is the best."
                )
            return best.step_nr
        assert isinstance(which, int)
        if which not in {info.step_nr for info in infos}:
            raise CheckpointNotFoundError(
                f"There is no committed checkpoint of step {which} in {self._dir}; "
                f"the steps there are {', '.join(str(i.step_nr) for i in infos)}."
            )
        return which

    # ----------------------------------------------------------------- loading

    def load_last_checkpoint(
        self, *, model: Module, optimizer: Optimizer, reshard: bool = False
    ) -> LoadedCheckpoint | None:
        """Load the newest intact full checkpoint into ``model`` and ``optimizer``.

        A damaged checkpoint is skipped with a warning in favour of the one before it. Returns
        ``None`` when there is no checkpoint to resume from.

        A different world layout is not damage: :class:`CheckpointLayoutError` propagates, unless
        ``reshard`` (see :meth:`load_checkpoint`). Skipped
        checkpoints are renamed to ``step_N.damaged`` once an older one has loaded, so the resumed
        run can save those steps again.
        """
        candidates = self._resume_candidates()
        damaged: list[int] = []
        for step_nr in reversed(candidates):
            try:
                loaded = self.load_checkpoint(
                    step_nr, model=model, optimizer=optimizer, reshard=reshard
                )
            except CheckpointLayoutError:
                raise
            except CheckpointError as ex:
                log.warning(
                    "Skipping the checkpoint of step %d, which is damaged, and falling back to "
                    "the one before it: %s",
                    step_nr,
                    ex,
                )
                damaged.append(step_nr)
                continue
            if damaged:
                self._move_aside(damaged)
                log.warning(
                    "Resumed from the checkpoint of step %d instead of the damaged one of step %d.",
                    step_nr,
                    damaged[0],
                )
            return loaded
        if candidates:
            raise CheckpointError(
                f"None of the checkpoints in {self._dir} (steps {candidates}) is intact. "
                "Move the directory away to start from scratch."
            )
        return None

    def _resume_candidates(self) -> list[int]:
        """Committed steps that may hold a full checkpoint: unreadable manifests count, as damaged."""
        steps: list[int] = []
        if not self._dir.is_dir():
            return steps
        for path in self._dir.iterdir():
            match = _STEP_DIR.match(path.name)
            if match is None or not (path / MANIFEST_NAME).is_file():
                continue
            try:
                kind = _read_manifest(path).get("kind", "full")
            except CheckpointError:
                kind = "full"  # verification will call it damaged, with the reason
            if kind == "full":
                steps.append(int(match.group(1)))
        return sorted(steps)

    def _move_aside(self, step_nrs: list[int]) -> None:
        if self._root.rank == 0:
            for step_nr in step_nrs:
                path = self._step_dir(step_nr)
                target = path.with_name(path.name + ".damaged")
                suffix = 1
                while target.exists():
                    suffix += 1
                    target = path.with_name(f"{path.name}.damaged{suffix}")
                os.replace(path, target)
                log.warning(
                    "Moved the damaged checkpoint of step %d to %s; delete it once you no longer "
                    "need it for inspection.",
                    step_nr,
                    target,
                )
            _fsync_dir(self._dir)
        self._root.barrier()

    def load_checkpoint(
        self, step_nr: int, *, model: Module, optimizer: Optimizer, reshard: bool = False
    ) -> LoadedCheckpoint:
        """Verify and load the full checkpoint of ``step_nr``; raise CheckpointError if damaged.

        A checkpoint of another world layout is a :class:`CheckpointLayoutError`, unless
        ``reshard``: then DCP reshards the model and optimizer into this layout, and every rank
        gets the trainer state of rank 0 (``resharded`` is set on the result).
        """
        path = self._step_dir(step_nr)
        manifest = self._verified_manifest(path, step_nr)
        if manifest["kind"] != "full":
            raise CheckpointError(
                f"The checkpoint of step {step_nr} holds only the model (its optimizer and "
                "trainer state were pruned by retention), so training cannot resume from it."
            )
        resharded = self._check_layout(manifest, reshard=reshard)

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

        trainer_file = path / "trainer" / ("rank_0.pt" if resharded else self._rank_file())
        trainer_state = self._collective(
            "load the trainer state", lambda: torch.load(trainer_file, weights_only=True)
        )
        log.info("Loaded the checkpoint of step %d from %s.", step_nr, path)
        return LoadedCheckpoint(
            step_nr=step_nr, trainer_state=trainer_state, manifest=manifest, resharded=resharded
        )

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

    def _check_layout(self, manifest: Mapping[str, Any], *, reshard: bool) -> bool:
        """Whether the checkpoint must be resharded; an error if it must but may not be."""
        saved = (manifest["world_size"], manifest["dp_size"], manifest["tp_size"])
        now = (self._root.size, self._gangs.dp.size, self._gangs.tp.size)
        if saved == now:
            return False
        if not reshard:
            raise CheckpointLayoutError(
                f"The checkpoint of step {manifest['step_nr']} in {self._dir} was saved by "
                f"{_describe_layout(*saved)}, but this run has {_describe_layout(*now)}. Resume "
                f"with {saved[0]} processes and tp_size {saved[2]} for a bit-exact resume, or "
                "pass reshard_on_resume=True to the Trainer to reshard the model, optimizer and "
                "data position into this layout."
            )
        log.warning(
            "Resharding the checkpoint of step %d, saved by %s, into %s.",
            manifest["step_nr"],
            _describe_layout(*saved),
            _describe_layout(*now),
        )
        return True

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
        self._run_dcp(dcp_save, state, path)

    def _dcp_async_save(
        self, state: dict[str, Any], path: Path, group: ProcessGroup | None
    ) -> Future[Any]:
        if group is None:
            # The warning comes from the writer thread, outside any catch_warnings block here.
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=UserWarning
            )
            result = dcp_async_save(state, checkpoint_id=path, no_dist=True)
        else:
            result = dcp_async_save(state, checkpoint_id=path, process_group=group)
        if isinstance(result, AsyncSaveResponse):
            result.staging_completion.result()
            return result.upload_completion
        return result

    def _get_async_groups(self) -> tuple[ProcessGroup | None, ProcessGroup | None]:
        """Two gloo groups of the root gang's ranks, one per background write.

        The writes run collectives on threads of their own, so they must not share a process
        group with the training loop (or with each other): collectives on one group must be
        issued in the same order on every rank.
        """
        if self._root.size == 1:
            return None, None
        if self._async_groups is None:
            ranks = dist.get_process_group_ranks(self._root.as_process_group())
            self._async_groups = (
                dist.new_group(ranks, backend="gloo"),
                dist.new_group(ranks, backend="gloo"),
            )
        return self._async_groups

    def _dcp_load(self, state: dict[str, Any], path: Path) -> None:
        self._run_dcp(dcp_load, state, path)

    def _run_dcp(self, operation: Callable[..., object], state: dict[str, Any], path: Path) -> None:
        """``dcp.save`` or ``dcp.load`` over the root gang, or without one in a single process."""
        if self._root.size == 1:
            with _single_process_dcp():
                operation(state, checkpoint_id=path, no_dist=True)
        else:
            operation(state, checkpoint_id=path, process_group=self._root.as_process_group())

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

    def damaged_dirs(self) -> list[Path]:
        """Checkpoints a resume found damaged and moved aside to ``step_N.damaged``."""
        if not self._dir.is_dir():
            return []
        return sorted(path for path in self._dir.iterdir() if _DAMAGED_DIR.match(path.name))

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


def _describe_layout(world_size: int, dp_size: int, tp_size: int) -> str:
    processes = "1 process" if world_size == 1 else f"{world_size} processes"
    return f"{processes} (dp_size {dp_size} x tp_size {tp_size})"


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
