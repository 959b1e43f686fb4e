"""torchtnt: an AutoUnit (DDP strategy on a gang) driven by ``torchtnt.framework.train``."""

from __future__ import annotations

from typing import Any, final

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchtnt.framework.auto_unit import AutoUnit
from torchtnt.framework.callback import Callback
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TTrainUnit
from torchtnt.utils.prepare_module import DDPStrategy

from benchmarks.loops.common import make_data_loader
from benchmarks.loops.registry import LoopOptions
from benchmarks.probe import StepTimer, world_size
from benchmarks.workloads import StepPlan, Workload


@final
class WorkloadUnit(AutoUnit[Any]):
    def __init__(self, workload: Workload, **kwargs: Any) -> None:
        self.workload = workload
        super().__init__(**kwargs)

    def compute_loss(self, state: State, data: Any) -> tuple[Tensor, Any]:
        loss, num_targets = self.workload.loss(self.module, data)
        return loss / num_targets, None

    def configure_optimizers_and_lr_scheduler(
        self, module: nn.Module
    ) -> tuple[torch.optim.Optimizer, None]:
        return torch.optim.AdamW(module.parameters(), lr=self.workload.lr), None


@final
class StepClock(Callback):
    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer

    def on_train_step_end(self, state: State, unit: TTrainUnit) -> None:
        self._timer.step_end()


def run(workload: Workload, plan: StepPlan, options: LoopOptions) -> float:
    del options
    num_ranks = world_size()
    if num_ranks > 1:
        dist.init_process_group("gloo")
    unit = WorkloadUnit(
        workload,
        module=workload.make_model(),
        device=torch.device("cpu"),
        strategy=DDPStrategy() if num_ranks > 1 else None,
    )
    timer = StepTimer(num_warmup=plan.num_warmup, num_steps=plan.num_steps)
    train(
        unit,
        make_data_loader(workload, shard=num_ranks > 1),
        max_steps=plan.num_steps,
        callbacks=[StepClock(timer)],
    )
    return timer.seconds_per_step()
