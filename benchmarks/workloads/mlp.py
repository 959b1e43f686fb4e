"""W1: an MLP 32-64-64-10 classifying synthetic points, batch 32."""

from __future__ import annotations

import itertools
from typing import Any, final

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from benchmarks.workloads.base import StepPlan, Workload


def make_mlp(widths: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class MlpWorkload(Workload):
    widths = (32, 64, 64, 10)
    batch_size = 32
    num_points = 8192

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        self._inputs = torch.randn(self.num_points, self.widths[0], generator=generator)
        self._labels = torch.randint(0, self.widths[-1], (self.num_points,), generator=generator)

    def plan(self, *, quick: bool) -> StepPlan:
        return StepPlan(num_steps=120, num_warmup=20) if quick else StepPlan(1100, 100)

    def make_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return make_mlp(self.widths)

    def dataset(self) -> Dataset[Any]:
        return TensorDataset(self._inputs, self._labels)

    # torch's default, which DataLoader uses when given none: every contender stacks the same
    # examples into the same [inputs, labels].
    collate = staticmethod(default_collate)

    def num_examples(self) -> int:
        return self.num_points

    def slice_batch(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return self._inputs[start:stop], self._labels[start:stop]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels, reduction="sum"), labels.numel()


@final
class GpuMlpWorkload(MlpWorkload):
    """The GPU host-overhead case: an MLP 1024-4096-4096-1024 in float32, batch 256, whose step
    keeps one GPU busy for about a millisecond; the hand-written loop slices batches already on
    the GPU. Needs CUDA."""

    widths = (1024, 4096, 4096, 1024)
    batch_size = 256
    num_points = 16_384

    def __init__(self) -> None:
        super().__init__()
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._gpu_inputs = self._inputs.to(self._device)
        self._gpu_labels = self._labels.to(self._device)

    def plan(self, *, quick: bool) -> StepPlan:
        return StepPlan(num_steps=220, num_warmup=20) if quick else StepPlan(4100, 100)

    def make_model(self) -> nn.Module:
        return super().make_model().to(self._device)

    def slice_batch(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return self._gpu_inputs[start:stop], self._gpu_labels[start:stop]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        # A no-op for batches on the GPU already (the hand-written loop's, or the Trainer's when
        # it places batches itself).
        inputs, labels = (t.to(self._device, non_blocking=True) for t in batch)
        return super().loss(model, (inputs, labels))
