"""What a step-time workload gives every loop: a model, a map dataset, a batch and a loss."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, final

from torch import Tensor, nn
from torch.utils.data import Dataset


@final
@dataclass(frozen=True)
class StepPlan:
    num_steps: int
    num_warmup: int


class Workload(ABC):
    """One model and its data; the loops differ only in how they drive them.

    ``loss`` returns the loss summed over the batch and the number of targets, which is what this
    project's units return; the other loops divide one by the other, the usual mean loss.
    """

    batch_size: int
    lr: float = 1e-3
    seed: int = 0

    @abstractmethod
    def plan(self, *, quick: bool) -> StepPlan: ...

    @abstractmethod
    def make_model(self) -> nn.Module: ...

    @abstractmethod
    def dataset(self) -> Dataset[Any]:
        """A map-style dataset of single examples, for the readers and DataLoaders."""

    @abstractmethod
    def collate(self, examples: list[Any]) -> Any: ...

    @abstractmethod
    def num_examples(self) -> int: ...

    @abstractmethod
    def slice_batch(self, start: int, stop: int) -> Any:
        """Examples ``start`` to ``stop`` as one batch: how a hand-written loop feeds itself."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, int]: ...
