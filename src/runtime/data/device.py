"""Batches on the device: the Trainer moves every micro-batch to ``gangs.root.device``.

:func:`move_to_device` copies the tensors inside a batch (dicts, lists, tuples, named tuples,
dataclasses, and any object with a ``to(device, non_blocking=...)`` method); other leaves stay as
they are. On CUDA, :class:`DeviceDataReader` pins each step's batches and copies them on a copy
stream of its own one step ahead, so the copy overlaps the previous step's kernels: the host never
waits for a copy, and a step's kernels wait on the device for its batch (an event), never longer.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, final

import torch
from torch import Tensor
from typing_extensions import override

from runtime.data.data_reader import DataReader, DataReaderWrapper

BatchT = TypeVar("BatchT")
T = TypeVar("T")


def move_to_device(batch: T, device: torch.device, *, non_blocking: bool = False) -> T:
    """``batch`` with every tensor inside it on ``device``; a tensor already there is kept."""
    moved: T = _map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking), device)
    return moved


def tensor_devices(batch: Any) -> set[torch.device]:
    """The devices of the tensors inside ``batch``, found where :func:`move_to_device` finds
    them (objects that move themselves with ``to()`` are not looked into)."""
    devices: set[torch.device] = set()

    def note(tensor: Tensor) -> Tensor:
        devices.add(tensor.device)
        return tensor

    _map_tensors(batch, note)
    return devices


def pin_memory(batch: T) -> T:
    """``batch`` with every CPU tensor inside it in pinned (page-locked) host memory, so that a
    ``non_blocking`` copy to CUDA does not make the host wait. An object that moves itself with
    ``to()`` is pinned by its ``pin_memory()`` method, when it has one (as torch's own batches
    do); without one, its copy waits for the host."""
    pinned: T = _map_tensors(
        batch,
        lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t,
        pin=True,
    )
    return pinned


def _map_tensors(
    value: Any,
    fn: Callable[[Tensor], Tensor],
    device: torch.device | None = None,
    pin: bool = False,
) -> Any:
    """``value`` with ``fn`` applied to each tensor inside it; other leaves move to ``device``
    with their ``to()``, or pin with their ``pin_memory()`` with ``pin``, when they can."""
    if isinstance(value, Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = copy.copy(value)
        for field in dataclasses.fields(value):
            # object.__setattr__: frozen dataclasses too.
            object.__setattr__(
                moved, field.name, _map_tensors(getattr(value, field.name), fn, device, pin)
            )
        return moved
    if isinstance(value, Mapping):
        items = {key: _map_tensors(item, fn, device, pin) for key, item in value.items()}
        return items if type(value) is dict else _rebuild(value, items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map_tensors(item, fn, device, pin) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn, device, pin) for item in value)
    if device is not None and callable(getattr(value, "to", None)):
        return value.to(device, non_blocking=True)
    if pin and callable(getattr(value, "pin_memory", None)):
        return value.pin_memory()
    return value


def _rebuild(mapping: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    try:
        return type(mapping)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


@dataclass(frozen=True)
class _StepAhead(Generic[BatchT]):
    """A step read ahead of the loop, with the reader's position before it; ``batches`` is None
    at the end of the data epoch."""

    batches: list[BatchT] | None
    state_before: dict[str, object]
    copied: torch.cuda.Event | None = None


@final
class _CopyStream:
    """Host-to-device copies on a CUDA stream of their own, so they overlap the compute stream.

    Before each copy the copy stream waits for the work queued so far on the compute stream. That
    orders the copy's writes after every kernel that used memory the allocator hands out again
    (the previous batches, freed on the host only once their kernels were queued), which also
    covers tensors inside objects that move themselves with ``to()``, where ``record_stream``
    cannot reach. The copy still overlaps the step being computed: it is issued one step ahead.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def start(self, batches: list[BatchT]) -> tuple[list[BatchT], torch.cuda.Event]:
        pinned = [pin_memory(batch) for batch in batches]
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            moved = [move_to_device(b, self._device, non_blocking=True) for b in pinned]
            copied = self._stream.record_event()
        return moved, copied

    def finish(self, copied: torch.cuda.Event) -> None:
        """Make the compute stream's next kernels wait for the copy: on the device, not the host."""
        torch.cuda.current_stream(self._device).wait_event(copied)


@final
class DeviceDataReader(DataReaderWrapper[BatchT]):
    """``reader`` with every micro-batch moved to ``device``.

    With ``read_ahead`` (the default on CUDA) the next step is read and its copy started as soon
    as a step is handed out; :meth:`state_dict` is still the position after the steps handed out,
    and the end of a data epoch still comes at the same step.
    """

    def __init__(
        self, reader: DataReader[BatchT], device: torch.device, *, read_ahead: bool | None = None
    ) -> None:
        super().__init__(reader)
        self._device = device
        self._read_ahead = device.type == "cuda" if read_ahead is None else read_ahead
        self._copies = _CopyStream(device) if device.type == "cuda" else None
        self._ahead: _StepAhead[BatchT] | None = None

    @override
    def __next__(self) -> list[BatchT]:
        if not self._read_ahead:
            return self._move(next(self._reader))
        step = self._ahead or self._read_step()
        self._ahead = None
        if step.batches is None:
            raise StopIteration
        if step.copied is not None and self._copies is not None:
            self._copies.finish(step.copied)
        self._ahead = self._read_step()
        return step.batches

    def _read_step(self) -> _StepAhead[BatchT]:
        state_before = self._reader.state_dict()
        try:
            batches = next(self._reader)
        except StopIteration:
            return _StepAhead(None, state_before)
        if self._copies is None:
            return _StepAhead(self._move(batches), state_before)
        moved, copied = self._copies.start(batches)
        return _StepAhead(moved, state_before, copied)

    def _move(self, batches: list[BatchT]) -> list[BatchT]:
        """``batches`` on the device now, on the current stream (pinned and non-blocking on
        CUDA, where a caller turned reading ahead off)."""
        cuda = self._copies is not None
        if cuda:
            batches = [pin_memory(batch) for batch in batches]
        return [move_to_device(b, self._device, non_blocking=cuda) for b in batches]

    @override
    def reset(self) -> None:
        self._ahead = None
        self._reader.reset()

    @override
    def state_dict(self) -> dict[str, object]:
        if self._ahead is not None:
            return self._ahead.state_before
        return self._reader.state_dict()

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._ahead = None
        self._reader.load_state_dict(state)

    @override
    def close(self) -> None:
        self._ahead = None
        self._reader.close()

    @override
    def for_evaluation(self) -> DataReader[BatchT]:
        return DeviceDataReader(
            self._reader.for_evaluation(), self._device, read_ahead=self._read_ahead
        )


__all__ = ["DeviceDataReader", "move_to_device", "pin_memory"]
