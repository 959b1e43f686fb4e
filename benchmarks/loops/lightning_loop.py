"""Lightning: a LightningModule whose training_step returns the mean loss; no logger, no checkpoints."""

from __future__ import annotations

from typing import Any, final

import lightning as L
import torch
from torch import Tensor

from benchmarks.loops.common import make_data_loader
from benchmarks.loops.registry import LoopOptions
from benchmarks.probe import StepTimer, world_size
from benchmarks.workloads import StepPlan, Workload


@final
class WorkloadModule(L.LightningModule):
    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.workload = workload
        self.model = workload.make_model()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, num_targets = self.workload.loss(self.model, batch)
        return loss / num_targets

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.workload.lr)


@final
class StepClock(L.Callback):
    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._timer.step_end()


def run(workload: Workload, plan: StepPlan, options: LoopOptions) -> float:
    del options
    num_ranks = world_size()
    timer = StepTimer(num_warmup=plan.num_warmup, num_steps=plan.num_steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=num_ranks,
        strategy="ddp" if num_ranks > 1 else "auto",
        max_steps=plan.num_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[StepClock(timer)],
    )
    # Lightning puts the DistributedSampler in itself.
    trainer.fit(WorkloadModule(workload), make_data_loader(workload, shard=False))
    return timer.seconds_per_step()
