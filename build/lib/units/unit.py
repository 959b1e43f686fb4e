"""The extension points users subclass: what one training or evaluation step computes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from torch import Tensor
from torch.nn import Module

from units.metric_bag import MetricBag

BatchT_contra = TypeVar("BatchT_contra", contravariant=True)


class TrainUnit(ABC, Generic[BatchT_contra]):
    """Computes the loss of one micro-batch.

    ``__call__`` returns the loss SUMMED over the batch's targets and the number of targets, so the
    Trainer can make each update the mean over every target of the step, across gradient
    accumulation and data-parallel ranks. Return ``None`` as the count when the loss is already a
    mean; each micro-batch then weighs the same.
    """

    def __init__(self, model: Module) -> None:
        self._model = model
        self.metric_bag = MetricBag()

    @abstractmethod
    def __call__(self, batch: BatchT_contra) -> tuple[Tensor, int | None]: ...

    def set_step_nr(self, step_nr: int) -> None:
        """Called before each step with its number (1-based); override to schedule things."""

    @property
    def model(self) -> Module:
        return self._model


class EvalUnit(ABC, Generic[BatchT_contra]):
    """Evaluates one batch, recording what it measures into :attr:`metric_bag`."""

    def __init__(self, model: Module, display_name: str | None = None) -> None:
        self._model = model
        self._display_name = display_name
        self.metric_bag = MetricBag()

    @abstractmethod
    def __call__(self, batch: BatchT_contra) -> None: ...

    def set_step_nr(self, step_nr: int) -> None:
        """Called before each evaluation with the training step it evaluates."""

    @property
    def model(self) -> Module:
        return self._model

    @property
    def display_name(self) -> str | None:
        return self._display_name
