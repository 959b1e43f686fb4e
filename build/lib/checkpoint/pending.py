"""A save in progress: the files each rank has written (with their digests), and its cleanup."""

from __future__ import annotations

import contextlib
import errno
import io
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, final

import torch

from checkpoint.errors import CheckpointError, exception_chain
from checkpoint.integrity import FileDigest, write_hashed
from checkpoint.storage import DcpStorage
from gangs import Gang


@final
@dataclass
class PendingSave:
    """A save not committed yet: sync until its commit, async until every write has landed."""

    step_nr: int
    tmp_dir: Path
    final_dir: Path
    score: float | None
    layout: dict[str, int]
    """The world layout of the saving run, for the manifest (:class:`WorldLayout`)."""
    excluded: list[str] = field(default_factory=list)
    """The model entries left out (``checkpoint_exclude``), for the manifest."""
    digests: dict[str, FileDigest] = field(default_factory=dict)
    """What this rank wrote, by path below the step directory."""
    uploads: list[Future[dict[str, FileDigest]]] = field(default_factory=list)
    """Background writes in flight, each giving the digests of the files it wrote."""
    upload_dirs: list[str] = field(default_factory=list)
    """The subdirectory each of ``uploads`` writes into."""

    def add(self, subdir: str, digests: dict[str, FileDigest]) -> None:
        self.digests.update({f"{subdir}/{name}": digest for name, digest in digests.items()})

    def start_upload(self, subdir: str, upload: Future[dict[str, FileDigest]]) -> None:
        self.uploads.append(upload)
        self.upload_dirs.append(subdir)

    def save_trainer(
        self, trainer_state: Mapping[str, Any], *, rank: int, background: bool = False
    ) -> None:
        """Write ``trainer/rank_R.pt``; with ``background``, only its serialization waits."""
        name = f"rank_{rank}.pt"
        buffer = io.BytesIO()
        torch.save(dict(trainer_state), buffer)  # the state as it is now, while the loop goes on
        file = self.tmp_dir / "trainer" / name
        if not background:
            self.add("trainer", {name: write_hashed(buffer.getbuffer(), file)})
            return
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-trainer-state")
        self.start_upload(
            "trainer", writer.submit(lambda: {name: write_hashed(buffer.getbuffer(), file)})
        )
        writer.shutdown(wait=False)

    def stage(
        self,
        storage: DcpStorage,
        model_state: dict[str, Any],
        optim_state: dict[str, Any],
        trainer_state: Mapping[str, Any],
        *,
        rank: int,
    ) -> None:
        """Copy the state to CPU memory and start writing it in the background, on this rank."""
        staged = [
            storage.stage(state, writer_nr=writer_nr)
            for writer_nr, state in enumerate((model_state, optim_state))
        ]
        # Its serialization too, before any writer thread contends for the GIL.
        self.save_trainer(trainer_state, rank=rank, background=True)
        for writer_nr, (subdir, state) in enumerate(
            zip(("model", "optimizer"), staged, strict=True)
        ):
            upload = storage.async_save(state, self.tmp_dir / subdir, writer_nr=writer_nr)
            self.start_upload(subdir, upload)

    def wait(self) -> None:
        """Wait for the background writes to end, whether they succeed or fail."""
        wait(self.uploads)

    def collect_uploads(self) -> None:
        """Wait for the background writes and take their digests; raise if one failed."""
        # Every write ends before a failure is reported, so the .tmp can then be removed.
        wait(self.uploads)
        for subdir, upload in zip(self.upload_dirs, self.uploads, strict=True):
            self.add(subdir, upload.result())


@contextlib.contextmanager
def removing_on_failure(gang: Gang, pending: PendingSave) -> Iterator[None]:
    """On a failed save, delete its ``.tmp`` directory (with a full disk, that frees room) and
    say that the earlier checkpoints are kept. Every rank raises: the failure is agreed on."""
    try:
        yield
    except CheckpointError as ex:
        pending.wait()  # no background write may recreate what is removed
        if gang.rank == 0:
            shutil.rmtree(pending.tmp_dir, ignore_errors=True)
        raise CheckpointError(
            f"The checkpoint of step {pending.step_nr} was not saved, and the earlier ones "
            f"are kept: {ex}{_disk_full_hint(ex)}"
        ) from ex


def _disk_full_hint(error: BaseException) -> str:
    for cause in exception_chain(error):
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            return (
                ". The disk (or a file size or quota limit) is full: free space, then run again "
                "to resume from the last checkpoint"
            )
    return ""
