"""This project's Trainer: MapDataReader, no validation or checkpoint while timed, rare publishing."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast, final

import torch
from torch import Tensor, nn

from benchmarks.loops.registry import LoopOptions
from benchmarks.probe import StepTimer
from benchmarks.workloads import StepPlan, Workload
from checkpoint import CheckpointManager
from gangs import setup_gangs
from runtime import MapDataReader, Trainer, TrainerCallback, apply_data_parallel
from runtime.data import MapDataset
from units import TrainUnit


@final
class WorkloadUnit(TrainUnit[Any]):
    def __init__(self, model: nn.Module, workload: Workload) -> None:
        super().__init__(model)
        self._workload = workload

    def __call__(self, batch: Any) -> tuple[Tensor, int | None]:
        return self._workload.loss(self.model, batch)


@final
class StepClock(TrainerCallback):
    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer

    def on_step_end(self, *, step_nr: int, metrics: Mapping[str, Any] | None) -> None:
        self._timer.step_end()


def run(workload: Workload, plan: StepPlan, options: LoopOptions) -> float:
    timer = StepTimer(num_warmup=plan.num_warmup, num_steps=plan.num_steps)
    make_trainer(workload, plan, options, StepClock(timer)).run()
    return timer.seconds_per_step()


def make_trainer(
    workload: Workload, plan: StepPlan, options: LoopOptions, callback: TrainerCallback
) -> Trainer[Any]:
    """The Trainer every step-time case times: ``callback`` sees each step's end."""
    gangs = setup_gangs(tp_size=1)
    model = apply_data_parallel(workload.make_model(), gangs, kind="ddp")
    # The runner gives every rank of a run the same fresh directory; the only checkpoint is the
    # one the Trainer writes after the last step, outside the timed steps.
    scratch = Path(os.environ["BENCH_SCRATCH"])
    return Trainer(
        unit=WorkloadUnit(model, workload),
        data_reader=MapDataReader(
            # Every workload's dataset has __len__, which MapDataset asks for.
            dataset=cast(MapDataset, workload.dataset()),
            batch_size=workload.batch_size,
            gang=gangs.dp,
            collate=workload.collate,
            seed=workload.seed,
            num_prefetch=options.num_prefetch,
        ),
        optimizer=torch.optim.AdamW(model.parameters(), lr=workload.lr),
        checkpoint_manager=CheckpointManager(scratch / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=plan.num_steps,
        publish_metrics_every_n_steps=plan.num_steps,
        callbacks=[callback],
        progress=False,
    )
