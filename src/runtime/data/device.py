"""Batches on the device: the Trainer moves every micro-batch to ``gangs.root.device``.

:func:`move_to_device` copies the tensors inside a batch (dicts, lists, tuples, named tuples,
dataclasses, and any object with a ``to(device, non_blocking=...)`` method); other leaves stay as
they are. On CUDA the reader's batches are pinned first and copied with ``non_blocking=True``:
the copy is queued on the current stream ahead of the step's kernels, so the host never waits
for it and the step never reads a batch before its copy finished (stream order).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, final

import torch
from torch import Tensor
from typing_extensions import override

from runtime.data.reader import DataReader

BatchT = TypeVar("BatchT")
T = TypeVar("T")


def move_to_device(batch: T, device: torch.device, *, non_blocking: bool = False) -> T:
    """``batch`` with every tensor inside it on ``device``; a tensor already there is kept."""
    moved: T = _map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking), device)
    return moved


def pin_memory(batch: T) -> T:
    """``batch`` with every CPU tensor inside it in pinned (page-locked) host memory, so that a
    ``non_blocking`` copy to CUDA does not make the host wait."""
    pinned: T = _map_tensors(
        batch, lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t
    )
    return pinned


def _map_tensors(
    value: Any, fn: Callable[[Tensor], Tensor], device: torch.device | None = None
) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = copy.copy(value)
        for field in dataclasses.fields(value):
            # object.__setattr__: frozen dataclasses too.
            object.__setattr__(
                moved, field.name, _map_tensors(getattr(value, field.name), fn, device)
            )
        return moved
    if isinstance(value, Mapping):
        items = {key: _map_tensors(item, fn, device) for key, item in value.items()}
        return items if type(value) is dict else _rebuild(value, items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map_tensors(item, fn, device) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn, device) for item in value)
    if device is not None and callable(getattr(value, "to", None)):
        return value.to(device, non_blocking=True)
    return value


def _rebuild(mapping: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    try:
        return type(mapping)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


@final
class DeviceDataReader(DataReader[BatchT]):
    """``reader`` with every micro-batch moved to ``device`` (pinned first on CUDA)."""

    def __init__(self, reader: DataReader[BatchT], device: torch.device) -> None:
        self._reader = reader
        self._device = device
        self._pin = device.type == "cuda"

    @override
    def __next__(self) -> list[BatchT]:
        batches = next(self._reader)
        if self._pin:
            batches = [pin_memory(batch) for batch in batches]
        return [move_to_device(b, self._device, non_blocking=self._pin) for b in batches]

    @override
    def reset(self) -> None:
        self._reader.reset()

    @override
    def state_dict(self) -> dict[str, object]:
        return self._reader.state_dict()

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reader.load_state_dict(state)

    @property
    @override
    def num_accumulate(self) -> int:
        return self._reader.num_accumulate

    @override
    def close(self) -> None:
        self._reader.close()

    @override
    def has_next_epoch(
        self, *, wait: bool = True, stop_requested: Callable[[], bool] | None = None
    ) -> bool:
        return self._reader.has_next_epoch(wait=wait, stop_requested=stop_requested)

    @override
    def for_evaluation(self) -> DataReader[BatchT]:
        return DeviceDataReader(self._reader.for_evaluation(), self._device)

    @property
    def reader(self) -> DataReader[BatchT]:
        """The reader whose batches this one moves."""
        return self._reader


__all__ = ["DeviceDataReader", "move_to_device", "pin_memory"]
