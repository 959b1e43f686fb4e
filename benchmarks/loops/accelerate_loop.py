"""Accelerate: ``Accelerator.prepare`` on the model, optimizer and DataLoader, then a plain loop."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from benchmarks.loops.common import endless, make_data_loader
from benchmarks.loops.registry import LoopOptions
from benchmarks.probe import StepTimer
from benchmarks.workloads import StepPlan, Workload


def run(workload: Workload, plan: StepPlan, options: LoopOptions) -> float:
    del options
    accelerator = Accelerator(cpu=True)
    model = workload.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    # prepare() shards the DataLoader over the ranks itself.
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, make_data_loader(workload, shard=False)
    )
    timer = StepTimer(num_warmup=plan.num_warmup, num_steps=plan.num_steps)
    batches = endless(loader)
    for _ in range(plan.num_steps):
        loss, num_targets = workload.loss(model, next(batches))
        accelerator.backward(loss / num_targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.step_end()
    return timer.seconds_per_step()
