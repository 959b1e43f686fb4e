"""Model and optimizer state through ``torch.distributed.checkpoint`` (DCP), sync and async.

DCP and the state-dict helpers import DTensor and more, slow to load; they are imported when a
checkpoint is first written or read, not when the package is.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

from gangs import Gang

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.nn import Module
    from torch.optim import Optimizer

StateDict = dict[str, Any]


def get_state_dicts(model: Module, optimizer: Optimizer) -> tuple[StateDict, StateDict]:
    """The model's and optimizer's state dicts, by parameter name, for any DDP/FSDP2/TP layout."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)


def set_state_dicts(
    model: Module, optimizer: Optimizer, model_state: StateDict, optim_state: StateDict
) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


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

    def save(self, state: StateDict, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        self._run(save, state, path)

    def load(self, state: StateDict, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict_loader import load

        self._run(load, state, path)

    def async_save(self, state: StateDict, path: Path, *, writer_nr: int) -> Future[Any]:
        """Stage ``state`` in CPU memory, then write it on a background thread; returns its future.

        Concurrent writes must differ in ``writer_nr``: each gets a process group of its own.
        """
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        if self._gang.size == 1:
            # The warning comes from the writer thread, outside any catch_warnings block here.
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled", category=UserWarning
            )
            result = async_save(state, checkpoint_id=path, no_dist=True)
        else:
            group = self._async_group(writer_nr)
            result = async_save(state, checkpoint_id=path, process_group=group)
        if isinstance(result, AsyncSaveResponse):
            result.staging_completion.result()
            return result.upload_completion
        return result

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

    def _run(self, operation: Callable[..., object], state: StateDict, path: Path) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            if self._gang.size == 1:
                with _single_process_dcp():
                    operation(state, checkpoint_id=path, no_dist=True)
            else:
                operation(state, checkpoint_id=path, process_group=self._gang.as_process_group())
        except CheckpointException as ex:
            # A BaseException: it would pass every `except Exception` (the agreement between
            # ranks, the command line's error handling). Its message is a traceback per rank, so
            # the message here is each rank's error, and the cause keeps the tracebacks.
            causes = "; ".join(
                f"rank {rank}: {type(error).__name__}: {error}"
                for rank, (error, _stack) in sorted(ex.failures.items())
            )
            raise RuntimeError(causes or str(ex)) from ex


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    # DCP warns that it "assumes" a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
