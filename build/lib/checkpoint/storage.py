"""Model and optimizer state through ``torch.distributed.checkpoint`` (DCP), sync and async.

DCP and the state-dict helpers import DTensor and more, slow to load; they are imported when a
checkpoint is first written or read, not when the package is.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

from checkpoint.errors import CheckpointError
from checkpoint.integrity import FileDigest, ReadDigests
from gangs import Gang

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.nn import Module
    from torch.optim import Optimizer

StateDict = dict[str, Any]

log = logging.getLogger(__name__)


def get_state_dicts(
    model: Module, optimizer: Optimizer | Sequence[Optimizer]
) -> tuple[StateDict, StateDict]:
    """The model's and optimizer's state dicts, by parameter name, for any DDP/FSDP2/TP layout."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _init_sparse_optimizer_state(optimizer)
    return get_state_dict(model, optimizer)


def set_state_dicts(
    model: Module,
    optimizer: Optimizer | Sequence[Optimizer],
    model_state: StateDict,
    optim_state: StateDict,
) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _init_sparse_optimizer_state(optimizer)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def _init_sparse_optimizer_state(optimizer: Optimizer | Sequence[Optimizer]) -> None:
    """Create the state of a ``SparseAdam`` that has none yet, by a step on empty sparse
    gradients (which touches no row).

    The state-dict helpers create a missing optimizer state by a step on dense zero gradients,
    which ``SparseAdam`` refuses; once it has a state, they leave it alone.
    """
    import torch

    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    for sparse in optimizers:
        if not isinstance(sparse, torch.optim.SparseAdam) or sparse.state:
            continue
        params = [p for group in sparse.param_groups for p in group["params"] if p.requires_grad]
        if any(p.grad is not None for p in params):
            continue
        for param in params:
            param.grad = torch.sparse_coo_tensor(
                torch.empty((1, 0), dtype=torch.int64, device=param.device),
                param.new_empty((0, *param.shape[1:])),
                param.shape,
                check_invariants=False,
            )
        # SparseAdam.step is untyped.
        step: Callable[[], object] = sparse.step
        step()
        sparse.zero_grad(set_to_none=True)


def get_model_state(model: Module) -> StateDict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def set_model_state(model: Module, state: StateDict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state)


@final
class DcpStorage:
    """Saves and loads DCP directories over ``gang``, or without a process group in one process."""

    def __init__(self, gang: Gang) -> None:
        self._gang = gang
        self._async_groups: list[ProcessGroup] = []
        self._staging: dict[int, tuple[FileSystemWriter, list[Any]]] = {}
        self._path_logged = False

    def _log_path(self) -> None:
        """Say once which way through DCP this process takes, if it is not the fast one."""
        from checkpoint.dcp_io import IO_ENV_VAR, fast_io_supported

        if self._path_logged or fast_io_supported():
            return
        self._path_logged = True
        import torch

        log.info(
            "Checkpoints go through the public API of torch.distributed.checkpoint (torch %s; "
            "the fast path is used on the torch versions it is tested with, or with %s=fast).",
            torch.__version__,
            IO_ENV_VAR,
        )

    def save(self, state: StateDict, path: Path) -> dict[str, FileDigest]:
        """Write ``state`` to ``path``; return the digest of each file this rank wrote there."""
        from torch.distributed.checkpoint.state_dict_saver import save

        from checkpoint.dcp_io import hashing_writer

        self._log_path()
        writer, digests = hashing_writer(path)
        self._run(save, state, storage_writer=writer)
        return digests

    def load(self, state: StateDict, path: Path, digests: ReadDigests | None = None) -> None:
        """Read ``path`` into ``state``; with ``digests``, hash this rank's share of the files as
        they are read (see :func:`checkpoint.dcp_io.safe_reader`)."""
        from torch.distributed.checkpoint.state_dict_loader import load

        from checkpoint.dcp_io import SafeLoadPlanner, safe_reader

        self._log_path()
        reader = safe_reader(path, digests)
        try:
            self._run(load, state, storage_reader=reader, planner=SafeLoadPlanner())
        except CheckpointError as ex:
            refusal = reader.metadata_error
            if refusal is None or str(refusal) in str(ex):
                raise
            # DCP of torch 2.11 drops why the metadata was refused.
            rank = self._gang.rank
            raise CheckpointError(f"{type(refusal).__name__} on rank {rank}: {refusal}") from ex

    def stage(self, state: StateDict, *, writer_nr: int) -> StateDict:
        """Copy ``state`` (the entries of it this rank writes) into the CPU buffers of the
        ``writer_nr``-th writer of asynchronous saves; :meth:`async_save` writes what it returns.

        Stage everything before the first :meth:`async_save` starts: a writer thread running
        meanwhile would take the GIL from the copy between its tensors.
        """
        from checkpoint.dcp_io import StagingWriter, own_entries

        self._log_path()
        staging = self._staging_writer(writer_nr, state)
        if self._gang.size > 1 and isinstance(staging, StagingWriter):
            staging.own_entries = own_entries(
                state, rank=self._gang.rank, gather=partial(self._gather, writer_nr)
            )
        return staging.stage(state)

    def async_save(
        self, staged: StateDict, path: Path, *, writer_nr: int
    ) -> Future[dict[str, FileDigest]]:
        """Write ``staged`` (from :meth:`stage`) on a background thread.

        The future gives the digest of each file this rank wrote. Concurrent writes must differ in
        ``writer_nr``: each gets a process group of its own.
        """
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        from checkpoint.dcp_io import STAGED, hashing_writer

        writer, digests = hashing_writer(path, reuse=self._staging[writer_nr][0])
        if self._gang.size == 1:
            # The warning comes from the writer thread, outside any catch_warnings block here.
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=UserWarning
            )
            result = async_save(staged, storage_writer=writer, async_stager=STAGED, no_dist=True)
        else:
            group = self._async_group(writer_nr)
            result = async_save(
                staged, storage_writer=writer, async_stager=STAGED, process_group=group
            )
        if isinstance(result, AsyncSaveResponse):
            result.staging_completion.result()
            result = result.upload_completion
        done: Future[dict[str, FileDigest]] = Future()

        def pass_on(upload: Future[Any]) -> None:
            error = upload.exception()
            if error is None:
                done.set_result(digests)
            else:
                done.set_exception(_as_error(error))

        result.add_done_callback(pass_on)
        return done

    def _staging_writer(self, writer_nr: int, state: StateDict) -> FileSystemWriter:
        """The ``writer_nr``-th writer of asynchronous saves, whose staging buffers fit ``state``.

        The caller must have waited for that writer's previous save: its buffers are reused.
        """
        from checkpoint.dcp_io import staging_writer

        layout = _layout_of(state)
        cached = self._staging.get(writer_nr)
        if cached is None or cached[1] != layout:
            # A new layout (an optimizer that gained its state, say) needs buffers of its own.
            cached = (staging_writer(), layout)
            self._staging[writer_nr] = cached
        return cached[0]

    def _gather(self, writer_nr: int, obj: Any) -> list[Any]:
        """``obj`` of every rank, over the group of the ``writer_nr``-th background write (idle
        now: the caller waited for that writer's previous save)."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self._gang.size
        dist.all_gather_object(gathered, obj, group=self._async_group(writer_nr))
        return gathered

    def _async_group(self, writer_nr: int) -> ProcessGroup:
        """A gloo group of the gang's ranks for the ``writer_nr``-th concurrent background write.

        The writes run collectives on threads of their own, so they must not share a process
        group with the training loop (or with each other): collectives on one group must be
        issued in the same order on every rank.
        """
        import torch.distributed as dist

        while len(self._async_groups) <= writer_nr:
            ranks = dist.get_process_group_ranks(self._gang.as_process_group())
            self._async_groups.append(dist.new_group(ranks, backend="gloo"))
        return self._async_groups[writer_nr]

    def close(self) -> None:
        """Release the process groups and staging buffers of background writes (the caller
        waited for them); the next background write sets them up again."""
        import torch.distributed as dist

        self._staging.clear()
        groups, self._async_groups = self._async_groups, []
        if dist.is_initialized():
            for group in groups:
                dist.destroy_process_group(group)

    def _run(self, operation: Callable[..., object], state: StateDict, **storage: Any) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            if self._gang.size == 1:
                with _single_process_dcp():
                    operation(state, no_dist=True, **storage)
            else:
                operation(state, process_group=self._gang.as_process_group(), **storage)
        except CheckpointException as ex:
            raise _as_error(ex)  # noqa: B904 - its __cause__ is the failure on the rank


def _layout_of(state: Any) -> list[Any]:
    """Keys, shapes and dtypes of a (nested) state dict: what its staging buffers must match."""
    import torch

    layout: list[Any] = []
    pending: list[tuple[str, Any]] = [("", state)]
    while pending:
        key, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{key}/{k}", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((f"{key}/{i}", v) for i, v in enumerate(value))
        elif isinstance(value, torch.Tensor):
            layout.append((key, tuple(value.shape), value.dtype, value.device))
        else:
            layout.append((key, type(value).__name__))
    return layout


def _as_error(error: BaseException) -> BaseException:
    """DCP's CheckpointException, which is no Exception, as a CheckpointError naming its cause.

    Left as it is, it would escape the ``except Exception`` of the agreement helpers, and the
    ranks that did not fail would wait for the failed one forever.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, CheckpointException):
        return error
    failures = sorted(error.failures.items())
    wrapped = CheckpointError(
        "; ".join(
            f"{type(cause).__name__} on rank {rank}: {cause}" for rank, (cause, _) in failures
        )
    )
    wrapped.__cause__ = failures[0][1][0]
    return wrapped


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    # DCP warns that it "assumes" a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
