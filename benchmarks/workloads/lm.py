"""W2: the char-LM recipe's 2-layer byte transformer on synthetic bytes, 16 x 128 targets a step."""

from __future__ import annotations

from typing import Any, final

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from benchmarks.workloads.base import StepPlan, Workload
from recipes.char_lm import ByteTransformer, ByteWindows, LMBatch, ModelSection, collate_windows


@final
class LmWorkload(Workload):
    batch_size = 16
    seq_len = 128
    num_windows = 2048

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        # Random bytes cost the model what text does; making them needs no corpus on disk.
        window = self.seq_len + 1
        self._bytes = torch.randint(
            0, 256, (self.num_windows * window + 1,), dtype=torch.uint8, generator=generator
        )
        self._windows = self._bytes[: self.num_windows * window].view(-1, window).long()

    def plan(self, *, quick: bool) -> StepPlan:
        return StepPlan(num_steps=6, num_warmup=2) if quick else StepPlan(30, 5)

    def make_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return ByteTransformer(ModelSection(), self.seq_len)

    def dataset(self) -> Dataset[Any]:
        return ByteWindows(self._bytes, self.seq_len)

    def collate(self, examples: list[Any]) -> LMBatch:
        return collate_windows(examples)

    def num_examples(self) -> int:
        return self.num_windows

    def slice_batch(self, start: int, stop: int) -> LMBatch:
        windows = self._windows[start:stop]
        return LMBatch(inputs=windows[:, :-1], targets=windows[:, 1:])

    def loss(self, model: nn.Module, batch: LMBatch) -> tuple[Tensor, int]:
        logits: Tensor = model(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")
        return loss, batch.num_targets
