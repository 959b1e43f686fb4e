"""A test-only detector of host-device synchronizations: the operations that make the host wait
for the device to read a value (``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor,
``nonzero``, ``torch.equal``, ``.cpu()``, ``.numpy()``, data-dependent shapes such as
``masked_select``), at the Python level and in the dispatcher.

On CPU no operation really waits, so every tensor counts as a device tensor: enable the detector
only around the work under test (the steady steps), not around the reader's index arithmetic.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_PYTHON_SYNCS: set[Callable[..., Any]] = {
    Tensor.item,
    Tensor.tolist,
    Tensor.numpy,
    Tensor.cpu,
    Tensor.__bool__,
    Tensor.__float__,
    Tensor.__int__,
    Tensor.__index__,
    Tensor.nonzero,
    Tensor.masked_select,
    Tensor.unique,
    torch.nonzero,
    torch.equal,
    torch.masked_select,
    torch.unique,
    torch.is_nonzero,
}

_DISPATCH_SYNCS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.equal.default",
    "aten.masked_select.default",
    "aten.is_nonzero.default",
    "aten._unique2.default",
}


class _Found:
    """The syncs found; ``inside`` while a Python-level sync runs, so that the dispatcher's view
    of the same operation does not count it twice."""

    def __init__(self, syncs: list[str]) -> None:
        self.syncs = syncs
        self.inside = False


class _FunctionSyncs(TorchFunctionMode):
    def __init__(self, found: _Found) -> None:
        super().__init__()
        self._found = found

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if self._found.inside or not (
            func in _PYTHON_SYNCS or (func is Tensor.to and _to_host(args, kwargs or {}))
        ):
            return func(*args, **(kwargs or {}))
        self._found.syncs.append(f"{getattr(func, '__name__', func)} at {_caller()}")
        self._found.inside = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._found.inside = False


class _DispatchSyncs(TorchDispatchMode):
    def __init__(self, found: _Found) -> None:
        super().__init__()
        self._found = found

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if str(func) in _DISPATCH_SYNCS and not self._found.inside:
            self._found.syncs.append(f"{func} at {_caller()}")
        return func(*args, **(kwargs or {}))


class HostSyncDetector:
    """``with HostSyncDetector() as detector: ...``; then ``detector.syncs`` lists each
    operation that would make the host wait, with the line that caused it. ``enter()`` and
    ``exit()`` do the same across callbacks."""

    def __init__(self) -> None:
        self.syncs: list[str] = []
        self._modes: list[Any] = []

    def enter(self) -> None:
        found = _Found(self.syncs)
        self._modes = [_FunctionSyncs(found), _DispatchSyncs(found)]
        for mode in self._modes:
            mode.__enter__()

    def exit(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []

    def __enter__(self) -> HostSyncDetector:
        self.enter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.exit()


def _to_host(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """``tensor.to("cpu")`` of a tensor that is not on the CPU."""
    source = args[0] if args else None
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return (
        isinstance(source, Tensor)
        and source.device.type != "cpu"
        and isinstance(target, (str, torch.device))
        and torch.device(target).type == "cpu"
    )


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "sync_detector" not in frame.filename and "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "?"
