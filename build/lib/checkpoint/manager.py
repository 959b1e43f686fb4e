"""Save, verify, list, prune and load checkpoints with an all-or-nothing commit.

A checkpoint of step N lives in ``step_N/``::

    step_N/
      model/          torch.distributed.checkpoint of the model (any DDP/FSDP2/TP layout)
      optimizer/      the same for the optimizer (absent in a model-only checkpoint)
      trainer/rank_R.pt   per-rank trainer state (step, data position, RNG, scheduler, ...)
      manifest.json   written last: files, sizes, digests, step, score, world layout, versions

Every rank writes into ``step_N.tmp/`` and hashes its files as it writes them; once all ranks
have finished, rank 0 gathers the digests, writes the manifest and renames the directory to
``step_N`` in one atomic step: a commit reads nothing back. A directory without a manifest, or
with a ``.tmp`` suffix, is never loaded and is removed when the next run starts.

With ``async_checkpoint=True`` the model and optimizer are staged (copied to CPU memory) while the
caller waits, then written by background threads over process groups of their own; the commit
happens in :meth:`CheckpointManager.finish_pending_save`, once every rank's write is durable.
Until then the checkpoint is only a ``.tmp`` directory, so a crash loses it but never exposes it.

Verification is shared, and a resume reads no byte for it alone: the ranks hash the files as DCP
reads them to load (see :mod:`checkpoint.manifest`), and all agree on the verdict. A committed
checkpoint that fails verification when the run resumes is skipped in favour of the one before it
and renamed to ``step_N.damaged`` (kept for inspection, never loaded), so that the resumed run can
write ``step_N`` again.

A checkpoint marked unhealthy (see :mod:`checkpoint.health`) is never resumed from; when the run,
rolled back, commits its step again, it is renamed to ``step_N.unhealthy`` first.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, final

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from checkpoint import directory, health
from checkpoint.base import AbstractCheckpointManager, LoadedCheckpoint
from checkpoint.directory import check_shared_directory
from checkpoint.errors import CheckpointError, on_all_ranks
from checkpoint.exclusion import excluded_names, pop_entries
from checkpoint.integrity import FileDigest
from checkpoint.layout import WorldLayout
from checkpoint.loading import CheckpointLoader
from checkpoint.manifest import (
    CheckpointChoice,
    list_checkpoints,
    make_manifest,
    prune_to_model,
    select_checkpoint,
    write_manifest,
)
from checkpoint.pending import PendingSave, removing_on_failure
from checkpoint.retention import CheckpointInfo, RetentionPolicy, plan_retention
from checkpoint.storage import DcpStorage, get_state_dicts
from gangs import Gangs
from trainkit_utils.files import fsync_dir

log = logging.getLogger(__name__)


@final
class CheckpointManager(AbstractCheckpointManager):
    """Owns one checkpoint directory; every rank of ``gangs.root`` must make the same calls."""

    def __init__(self, checkpoint_dir: Path, gangs: Gangs) -> None:
        self._dir = Path(checkpoint_dir)
        self._gangs = gangs
        self._root = gangs.root
        self._storage = DcpStorage(gangs.root)
        self._pending: PendingSave | None = None
        self._loader = CheckpointLoader(self._dir, gangs, self._storage)

    @property
    def checkpoint_dir(self) -> Path:
        return self._dir

    @property
    @override
    def pending_step_nr(self) -> int | None:
        """The step of an asynchronous save not committed yet, if there is one."""
        return None if self._pending is None else self._pending.step_nr

    # ------------------------------------------------------------------ saving

    @override
    def save_checkpoint(
        self,
        step_nr: int,
        *,
        model: Module,
        optimizer: Optimizer | Sequence[Optimizer],
        trainer_state: Mapping[str, Any],
        score: float | None = None,
        async_checkpoint: bool = False,
        exclude: Sequence[str] = (),
    ) -> None:
        """Write a full checkpoint of ``step_nr`` and commit it once every rank has finished.

        Model entries matched by a pattern of ``exclude`` are left out and listed in the
        manifest under ``excluded``.

        With ``async_checkpoint`` this returns once the model and optimizer are staged in CPU
        memory; they are written in the background and committed by :meth:`finish_pending_save`
        (which the next save calls first, if the caller has not).
        """
        self.finish_pending_save()
        final_dir = directory.step_dir(self._dir, step_nr)
        tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
        if self._root.rank == 0:
            # An unhealthy one (a rollback went back past it) is moved aside at the commit.
            if final_dir.exists() and health.unhealthy_reason(final_dir) is None:
                raise CheckpointError(f"A checkpoint of step {step_nr} exists already: {final_dir}")
            shutil.rmtree(tmp_dir, ignore_errors=True)
            (tmp_dir / "trainer").mkdir(parents=True)
        self._root.barrier()

        layout = WorldLayout.of(self._gangs, model).as_dict()
        pending = PendingSave(step_nr, tmp_dir, final_dir, score, layout)
        with removing_on_failure(self._root, pending):
            model_state, optim_state = get_state_dicts(model, optimizer)
            pending.excluded = excluded_names(model_state, exclude)
            pop_entries(model_state, pending.excluded)
            if async_checkpoint:
                on_all_ranks(
                    self._root,
                    "stage the checkpoint",
                    lambda: pending.stage(
                        self._storage, model_state, optim_state, trainer_state, rank=self._root.rank
                    ),
                )
                self._pending = pending
                log.info("Checkpoint of step %d staged; writing it in the background.", step_nr)
                return
            on_all_ranks(
                self._root,
                "save the model",
                lambda: pending.add("model", self._storage.save(model_state, tmp_dir / "model")),
            )
            on_all_ranks(
                self._root,
                "save the optimizer",
                lambda: pending.add(
                    "optimizer", self._storage.save(optim_state, tmp_dir / "optimizer")
                ),
            )
            on_all_ranks(
                self._root,
                "save the trainer state",
                lambda: pending.save_trainer(trainer_state, rank=self._root.rank),
            )
            self._commit(pending)

    @override
    def finish_pending_save(self) -> int | None:
        """Wait for the asynchronous save in flight, if any, and commit it; return its step.

        Every rank must call it. If the write failed on any rank (a full disk, say), its ``.tmp``
        directory is removed, the earlier checkpoints stay, and this raises
        :class:`CheckpointError` on every rank.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        with removing_on_failure(self._root, pending):
            on_all_ranks(
                self._root,
                f"write the checkpoint of step {pending.step_nr}",
                pending.collect_uploads,
            )
            self._commit(pending)
        return pending.step_nr

    def _commit(self, pending: PendingSave) -> None:
        # Each rank hashed what it wrote; rank 0 only gathers the digests, and reads nothing.
        rank_digests: list[dict[str, FileDigest]] = self._root.all_gather_objects(pending.digests)

        def commit() -> None:
            if self._root.rank != 0:
                return
            files = {name: digest for digests in rank_digests for name, digest in digests.items()}
            manifest = make_manifest(
                files,
                step_nr=pending.step_nr,
                score=pending.score,
                layout=pending.layout,
                excluded=pending.excluded,
            )
            write_manifest(pending.tmp_dir, manifest)
            health.move_aside_if_unhealthy(pending.final_dir)
            os.replace(pending.tmp_dir, pending.final_dir)
            fsync_dir(self._dir)

        on_all_ranks(self._root, "commit the checkpoint", commit)
        log.info("Checkpoint of step %d committed to %s.", pending.step_nr, pending.final_dir)

    # ----------------------------------------------------------------- listing

    @override
    def list_checkpoints(self) -> list[CheckpointInfo]:
        """The committed checkpoints (those with a readable manifest), oldest first."""
        return list_checkpoints(self._dir)

    @override
    def select_checkpoint(self, which: CheckpointChoice, *, lower_better: bool) -> int:
        """The step of the committed checkpoint ``which`` names (see :func:`select_checkpoint`)."""
        return select_checkpoint(self._dir, which, lower_better=lower_better)

    def damaged_dirs(self) -> list[Path]:
        """Checkpoints a resume found damaged and moved aside to ``step_N.damaged``."""
        return directory.scan(self._dir).damaged

    def replaced_dirs(self) -> list[Path]:
        """Unhealthy checkpoints moved aside to ``step_N.unhealthy`` by a newer save of step N."""
        return directory.scan(self._dir).replaced

    def incomplete_dirs(self) -> list[Path]:
        """Directories of saves that never committed (or deletes that never finished)."""
        return directory.scan(self._dir).incomplete

    # ----------------------------------------------------------------- loading

    @override
    def load_last_checkpoint(
        self, *, model: Module, optimizer: Optimizer | Sequence[Optimizer], reshard: bool = False
    ) -> LoadedCheckpoint | None:
        """Load the newest intact full checkpoint into ``model`` and ``optimizer``.

        A damaged checkpoint is skipped with a warning in favour of the one before it, and renamed
        to ``step_N.damaged`` once an older one has loaded, so the resumed run can save that step
        again. Returns ``None`` when there is no checkpoint to resume from. A different world
        layout is not damage: :class:`CheckpointLayoutError` propagates, unless ``reshard`` (see
        :meth:`load_checkpoint`). Nor is a failure of the machine while an intact checkpoint
        loads (out of memory, an import, a read error): :class:`CheckpointLoadError` propagates.
        """
        return self._loader.load_last(model=model, optimizer=optimizer, reshard=reshard)

    def load_checkpoint(
        self,
        step_nr: int,
        *,
        model: Module,
        optimizer: Optimizer | Sequence[Optimizer],
        reshard: bool = False,
    ) -> LoadedCheckpoint:
        """Verify and load the full checkpoint of ``step_nr``; raise CheckpointError if damaged.

        A checkpoint of another world layout is a :class:`CheckpointLayoutError`, unless
        ``reshard``: then DCP reshards the model and optimizer into this layout, and every rank
        gets the trainer state of rank 0 (``resharded`` is set on the result).
        """
        return self._loader.load(step_nr, model=model, optimizer=optimizer, reshard=reshard)

    @override
    def load_model(self, step_nr: int, *, model: Module) -> None:
        """Load only the model of the checkpoint of ``step_nr`` (full or model-only)."""
        self._loader.load_model(step_nr, model=model)

    def read_model_state(self, step_nr: int) -> dict[str, Any]:
        """The verified model of the checkpoint of ``step_nr`` as a plain state dict (one process;
        for export)."""
        from checkpoint.dcp_io import load_whole

        self.verify(step_nr)
        return load_whole(directory.step_dir(self._dir, step_nr) / "model")

    def verify(self, step_nr: int) -> dict[str, Any]:
        """Check sizes and digests of the checkpoint of ``step_nr``; return its manifest.

        Every rank must call it: each reads its share of the files once, and all agree on the
        verdict (CheckpointError on every rank if any share is damaged).
        """
        return self._loader.verify(step_nr)

    @override
    def prepare(self) -> None:
        """Check that every rank shares the directory, then remove what interrupted saves and
        deletes left behind (see :meth:`check_shared_directory`, :meth:`remove_leftovers`)."""
        self.check_shared_directory()
        self.remove_leftovers()

    @override
    def checkpoint_path(self, step_nr: int) -> Path:
        return directory.step_dir(self._dir, step_nr)

    @override
    def close(self) -> None:
        """Wait for the background writes of an uncommitted save (which stays uncommitted: its
        ``.tmp`` directory goes when the next run starts) and release their process groups.

        The manager stays usable: the next asynchronous save sets them up again.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        self._storage.close()

    def check_shared_directory(self) -> None:
        """Make sure every rank sees rank 0's checkpoint directory; every rank must call it.

        Raises :class:`CheckpointDirectoryError` on every rank if not, before any training.
        """
        check_shared_directory(self._root, self._dir)

    @override
    def mark_unhealthy(self, step_nrs: Sequence[int], *, reason: str) -> None:
        """Rank 0 writes ``unhealthy.json`` into each (see :mod:`checkpoint.health`)."""
        self.finish_pending_save()
        mark = partial(health.mark_unhealthy, self._dir, step_nrs, reason=reason)
        self._loader.verdict(
            "mark checkpoints unhealthy", mark if self._root.rank == 0 else lambda: None
        )

    # --------------------------------------------------------------- retention

    @override
    def apply_retention(self, policy: RetentionPolicy, *, lower_better: bool = True) -> None:
        """Delete or prune to model-only what ``policy`` does not keep; committed ones only."""
        if self._root.rank == 0:
            health.mark_permanent(self._dir, policy)
            plan = plan_retention(self.list_checkpoints(), policy, lower_better=lower_better)
            for step_nr in plan.prune_to_model:
                prune_to_model(directory.step_dir(self._dir, step_nr))
                log.info("Pruned the checkpoint of step %d to its model.", step_nr)
            for step_nr in plan.delete:
                self.delete_checkpoint(step_nr)
        self._root.barrier()

    def delete_checkpoint(self, step_nr: int) -> None:
        """Remove a checkpoint; the manifest goes first, so a crash midway leaves it invisible."""
        directory.delete(directory.step_dir(self._dir, step_nr))
        log.info("Deleted the checkpoint of step %d.", step_nr)

    def remove_leftovers(self) -> None:
        """Delete what interrupted saves and deletes left behind; every rank must call it.

        Only a run that owns the directory may call it: a save in progress looks the same.
        """
        if self._root.rank == 0:
            directory.remove_incomplete(self._dir)
        self._root.barrier()
