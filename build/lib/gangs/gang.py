"""The :class:`Gang` abstraction: a group of processes that run collectives together."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from enum import Enum
from typing import Any, TypeVar, final

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import (  # type: ignore[attr-defined]
    HashStore,
    ProcessGroup,
    Store,
    TCPStore,
)
from typing_extensions import override

from gangs.torch_versions import private_apis_supported


class GangError(RuntimeError):
    """Raised when a gang cannot be set up or one of its collectives fails."""


class ReduceOperation(Enum):
    SUM = "sum"
    MEAN = "mean"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


class PendingCollective:
    """A collective started by a ``*_async`` gang method; ``wait()`` blocks until it is done."""

    def wait(self) -> None:
        """Return once the collective has finished on this rank (raises GangError on failure)."""


_DONE = PendingCollective()


class Gang(ABC):
    """A group of processes, each with a rank in ``[0, size)``, that run collectives together."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def close(self) -> None:
        """Release the gang's resources; the gang is unusable afterwards."""

    @abstractmethod
    def make_gang(self, ranks: Sequence[int]) -> Gang | None:
        """Make a sub-gang of ``ranks``; every rank of this gang must call it.

        Returns ``None`` on the ranks that are not in ``ranks``.
        """

    @abstractmethod
    def as_process_group(self) -> ProcessGroup:
        """Return the ``torch.distributed`` process group behind the gang."""

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        """Reduce ``tensor`` over all ranks in place."""

    def all_reduce_async(self, tensor: Tensor, op: ReduceOperation) -> PendingCollective:
        """Start reducing ``tensor`` over all ranks in place; ``wait()`` on the result before
        reading it. Work done meanwhile (a backward pass) overlaps the communication."""
        self.all_reduce(tensor, op)
        return _DONE

    @abstractmethod
    def all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        """Gather ``input_tensor`` from all ranks into ``output_tensor``, stacked on a new dim 0."""

    @abstractmethod
    def all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        """Gather ``input_tensor`` from all ranks into ``output_tensors``, one per rank."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, source_rank: int = 0) -> None: ...

    @abstractmethod
    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        """Replace ``objects`` in place on every rank with those of ``source_rank``.

        The objects are pickled: only use it between the processes of one run.
        """

    @abstractmethod
    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Return the ``obj`` of every rank, in rank order (pickled, like ``broadcast_objects``)."""


@final
class FakeGang(Gang):
    """A gang of one process: every collective is the identity, nothing is communicated."""

    def __init__(self, *, device: torch.device | None = None) -> None:
        self._device = device if device is not None else torch.device("cpu")

    @property
    @override
    def rank(self) -> int:
        return 0

    @property
    @override
    def size(self) -> int:
        return 1

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @override
    def close(self) -> None:
        pass

    @override
    def make_gang(self, ranks: Sequence[int]) -> Gang | None:
        _check_ranks(ranks, self.size)
        return self if 0 in ranks else None

    @override
    def as_process_group(self) -> ProcessGroup:
        raise GangError(
            "A FakeGang has no process group. Launch with torchrun and more than one process "
            "to use APIs that need torch.distributed."
        )

    @override
    def barrier(self) -> None:
        pass

    @override
    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        pass

    @override
    def all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        output_tensor.copy_(input_tensor.unsqueeze(0))

    @override
    def all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        if len(output_tensors) != 1:
            raise GangError(
                f"output_tensors must have one tensor per rank (1), but has {len(output_tensors)}."
            )
        output_tensors[0].copy_(input_tensor)

    @override
    def broadcast(self, tensor: Tensor, source_rank: int = 0) -> None:
        _check_ranks([source_rank], self.size)

    @override
    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        _check_ranks([source_rank], self.size)

    @override
    def all_gather_objects(self, obj: Any) -> list[Any]:
        return [obj]


_REDUCE_OPS = {
    ReduceOperation.SUM: dist.ReduceOp.SUM,
    ReduceOperation.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOperation.MIN: dist.ReduceOp.MIN,
    ReduceOperation.MAX: dist.ReduceOp.MAX,
}

T = TypeVar("T")


@final
class ProcessGroupGang(Gang):
    """A gang over a ``torch.distributed`` process group."""

    def __init__(
        self,
        process_group: ProcessGroup,
        *,
        device: torch.device,
        timeout: timedelta | None = None,
    ) -> None:
        """``timeout`` is the group's collective timeout, if known; it only shapes error messages."""
        self._pg = process_group
        self._rank = dist.get_rank(process_group)
        self._size = dist.get_world_size(process_group)
        self._device = device
        self._timeout = timeout

    @classmethod
    def init_default(
        cls, *, device: torch.device, timeout: timedelta, alone: bool = False
    ) -> ProcessGroupGang:
        """Initialize the default process group from the ``torchrun`` environment; ``alone``:
        a group of this process only, met through an in-process store (no port, no launcher)."""
        # gloo carries CPU tensors (objects, metric states) next to nccl on CUDA.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        rendezvous: dict[str, Any] = (
            {"store": HashStore(), "rank": 0, "world_size": 1} if alone else {}
        )
        try:
            if not dist.is_initialized():
                with _stop_signals_end_the_process():
                    dist.init_process_group(
                        backend, timeout=timeout, device_id=_device_id(device), **rendezvous
                    )
                # A process that exits with the group alive aborts in the C++ destructor.
                atexit.register(_destroy_default_group)
        except (RuntimeError, ValueError) as ex:
            raise GangError(
                f"The default process group cannot be initialized with backend '{backend}': {ex}"
            ) from ex
        default_group = dist.group.WORLD
        assert default_group is not None
        return cls(default_group, device=device, timeout=timeout)

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def size(self) -> int:
        return self._size

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @property
    def timeout(self) -> timedelta | None:
        """The collective timeout of the group, when the gang was made knowing it."""
        return self._timeout

    @override
    def close(self) -> None:
        if self._pg is dist.group.WORLD:
            _destroy_default_group()
        elif dist.is_initialized():
            dist.destroy_process_group(self._pg)

    @override
    def make_gang(self, ranks: Sequence[int]) -> Gang | None:
        _check_ranks(ranks, self._size)
        global_ranks = [dist.get_global_rank(self._pg, r) for r in ranks]
        # new_group is collective over the default group, so every rank makes every group. Without
        # a timeout it would get torch's default (30 minutes), not this gang's.
        group = self._run("make_gang", lambda: dist.new_group(global_ranks, timeout=self._timeout))
        if self._rank not in ranks:
            return None
        if len(ranks) == 1:
            return FakeGang(device=self._device)
        return ProcessGroupGang(group, device=self._device, timeout=self._timeout)

    @override
    def as_process_group(self) -> ProcessGroup:
        return self._pg

    @override
    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(group=self._pg))

    @override
    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        if op is ReduceOperation.MEAN:
            # gloo has no AVG, so MEAN is a SUM followed by a division on every backend.
            self._run("all_reduce", lambda: dist.all_reduce(tensor, dist.ReduceOp.SUM, self._pg))
            tensor.div_(self._size)
        else:
            self._run("all_reduce", lambda: dist.all_reduce(tensor, _REDUCE_OPS[op], self._pg))

    @override
    def all_reduce_async(self, tensor: Tensor, op: ReduceOperation) -> PendingCollective:
        if op is ReduceOperation.MEAN:
            return super().all_reduce_async(tensor, op)
        work = self._run(
            "all_reduce", lambda: dist.all_reduce(tensor, _REDUCE_OPS[op], self._pg, async_op=True)
        )
        return _PendingWork(work, self)

    @override
    def all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        if output_tensor.shape != (self._size, *input_tensor.shape):
            raise GangError(
                f"output_tensor must have shape {(self._size, *input_tensor.shape)} (gang size "
                f"first, then the input's shape), but has {tuple(output_tensor.shape)}."
            )
        # Stacking equals concatenating the flattened inputs, the one layout every backend takes.
        self._run(
            "all_gather",
            lambda: dist.all_gather_into_tensor(
                output_tensor.view(-1), input_tensor.reshape(-1), group=self._pg
            ),
        )

    @override
    def all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        if len(output_tensors) != self._size:
            raise GangError(
                f"output_tensors must have one tensor per rank ({self._size}), "
                f"but has {len(output_tensors)}."
            )
        self._run("all_gather", lambda: dist.all_gather(output_tensors, input_tensor, self._pg))

    @override
    def broadcast(self, tensor: Tensor, source_rank: int = 0) -> None:
        _check_ranks([source_rank], self._size)
        src = dist.get_global_rank(self._pg, source_rank)
        self._run("broadcast", lambda: dist.broadcast(tensor, src, self._pg))

    @override
    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        _check_ranks([source_rank], self._size)
        src = dist.get_global_rank(self._pg, source_rank)
        self._run("broadcast_objects", lambda: dist.broadcast_object_list(objects, src, self._pg))

    @override
    def all_gather_objects(self, obj: Any) -> list[Any]:
        output: list[Any] = [None] * self._size
        self._run("all_gather_objects", lambda: dist.all_gather_object(output, obj, self._pg))
        return output

    def _run(self, name: str, collective: Callable[[], T]) -> T:
        try:
            return collective()
        except (RuntimeError, ValueError) as ex:
            if is_collective_timeout(ex):
                raise self.timeout_error(f"The {name} collective", ex) from ex
            raise GangError(
                f"The {name} collective failed on rank {self._rank} of a gang of {self._size}: {ex}"
            ) from ex

    def timeout_error(self, what: str, ex: BaseException) -> GangError:
        """A :class:`GangError` for the timeout ``ex`` of ``what``, naming the ranks that hung.

        Every rank whose collective timed out must call it (``_run`` does): the ranks that do not
        are reported as the ones that never reached the collective.
        """
        after = f" after {self._timeout}" if self._timeout is not None else ""
        return GangError(
            f"{what} timed out on rank {self._rank} of a gang of {self._size}{after}: "
            f"{self._stalled(what)} {ex}"
        )

    def _stalled(self, name: str) -> str:
        """Which ranks never reached the collective, as far as the rendezvous store can tell.

        Every rank whose collective timed out says so in the store; after a grace period the
        ranks that did not are the ones that hung (or left). Best effort: without a store, or
        when a store call fails, the ranks are not named.
        """
        global_ranks = [dist.get_global_rank(self._pg, r) for r in range(self._size)]
        prefix = f"trainkit/collective_timeout/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        grace = _TIMEOUT_REPORT_GRACE
        if self._timeout is not None:
            grace = min(grace, self._timeout.total_seconds() / 2)
        try:
            store = _rendezvous_store(grace)
            store.set(f"{prefix}/{dist.get_rank()}", name)
            deadline = time.monotonic() + grace
            while True:
                reported = [store.check([f"{prefix}/{r}"]) for r in global_ranks]
                if all(reported) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except (RuntimeError, ValueError, AttributeError, KeyError):
            return "the ranks that did not reach it are unknown."
        missing = [r for r, ok in zip(range(self._size), reported, strict=True) if not ok]
        if not missing:
            return "every rank reached it, so the network or a peer's backend stalled."
        return (
            f"rank {', '.join(map(str, missing))} of the gang did not reach it "
            f"(hung, or busy outside collectives for longer than the timeout)."
        )


def _rendezvous_store(grace: float) -> Store:
    """The store every rank reaches: the default group's, a private API, on the tested torch
    versions (see :mod:`gangs.torch_versions`); else a new client of the store at
    ``MASTER_ADDR:MASTER_PORT`` that the ranks met through (torchrun's, or rank 0's)."""
    if private_apis_supported():
        store: Store = dist.distributed_c10d._get_default_store()
        return store
    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=grace),
    )


_TIMEOUT_REPORT_GRACE = 10.0
"""The most seconds a timed-out rank waits for the others to report their own timeouts."""


_TIMEOUT_WORDINGS = ("timed out", "timeout caused pair closure")
"""How gloo and nccl word a collective's timeout. gloo says the second when the timeout struck
another operation on the same connection first (DDP's gradient all-reduce on its own thread,
say): the operation that then fails timed out all the same."""


def is_collective_timeout(ex: BaseException) -> bool:
    """Whether ``ex`` is a backend's collective timeout."""
    message = str(ex).lower()
    return isinstance(ex, RuntimeError) and any(words in message for words in _TIMEOUT_WORDINGS)


@final
class _PendingWork(PendingCollective):
    def __init__(self, work: Any, gang: ProcessGroupGang) -> None:
        self._work = work
        self._gang = gang

    @override
    def wait(self) -> None:
        self._gang._run("all_reduce", self._work.wait)


def _check_ranks(ranks: Sequence[int], size: int) -> None:
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise GangError(f"Ranks must be in [0, {size}), but {bad} are not.")


@contextlib.contextmanager
def _stop_signals_end_the_process() -> Iterator[None]:
    """Give SIGTERM its default action (end the process) while a rank waits in the rendezvous.

    That wait is in C++, where no Python signal handler runs: a rank whose peer never comes
    (it refused to start, or died) would ignore the launcher's SIGTERM until the launcher kills
    it. Outside the main thread, where Python cannot change handlers, it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None
