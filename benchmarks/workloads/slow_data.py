"""The data-bound case: an MLP step and a dataset whose examples take about as long to make.

Each ``__getitem__`` sleeps, as a reader waiting on storage or a decoder would; sleeping releases
the GIL, so a prefetching reader can make the next batch while the step runs.
"""

from __future__ import annotations

import time
from typing import Any, final

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from benchmarks.workloads.base import StepPlan, Workload
from benchmarks.workloads.mlp import make_mlp


@final
class SlowPoints(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, inputs: Tensor, labels: Tensor, *, delay_s: float) -> None:
        self._inputs = inputs
        self._labels = labels
        self._delay_s = delay_s

    def __len__(self) -> int:
        return self._labels.numel()

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        time.sleep(self._delay_s)
        return self._inputs[index], self._labels[index]


@final
class SlowDataWorkload(Workload):
    widths = (256, 512, 512, 10)
    batch_size = 16
    num_points = 4096
    example_delay_s = 2e-4
    """16 examples sleep about 3.2 ms plus the sleeps' overhead, near the step's compute time."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self._inputs = torch.randn(self.num_points, self.widths[0], generator=generator)
        self._labels = torch.randint(0, self.widths[-1], (self.num_points,), generator=generator)
        self._dataset = SlowPoints(self._inputs, self._labels, delay_s=self.example_delay_s)

    def plan(self, *, quick: bool) -> StepPlan:
        return StepPlan(num_steps=30, num_warmup=5) if quick else StepPlan(230, 30)

    def make_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return make_mlp(self.widths)

    def dataset(self) -> Dataset[Any]:
        return self._dataset

    def collate(self, examples: list[Any]) -> tuple[Tensor, Tensor]:
        inputs, labels = zip(*examples, strict=True)
        return torch.stack(inputs), torch.stack(labels)

    def num_examples(self) -> int:
        return self.num_points

    def slice_batch(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        # A hand-written loop cannot slice its way past a slow source: it reads every example.
        return self.collate([self._dataset[index] for index in range(start, stop)])

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels, reduction="sum"), labels.numel()
