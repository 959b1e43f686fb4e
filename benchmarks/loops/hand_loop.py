"""The floor: the loop a user writes by hand, fed by slicing tensors already in memory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from benchmarks.loops.registry import LoopOptions
from benchmarks.probe import StepTimer, rank, world_size
from benchmarks.workloads import StepPlan, Workload


def run(workload: Workload, plan: StepPlan, options: LoopOptions) -> float:
    del options
    num_ranks, my_rank = world_size(), rank()
    model = workload.make_model()
    if num_ranks > 1:
        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    timer = StepTimer(num_warmup=plan.num_warmup, num_steps=plan.num_steps)
    for step_nr in range(plan.num_steps):
        start = slice_start(workload, step_nr, num_ranks=num_ranks, rank=my_rank)
        hand_step(workload, model, optimizer, start)
        timer.step_end()
    return timer.seconds_per_step()


def slice_start(workload: Workload, step_nr: int, *, num_ranks: int, rank: int) -> int:
    """The first example of this rank's batch of step ``step_nr`` (counted from 0): the ranks
    take consecutive batches, and an epoch ends where the data runs out for all of them."""
    batch_size = workload.batch_size
    steps_per_epoch = workload.num_examples() // (batch_size * num_ranks)
    return ((step_nr % steps_per_epoch) * num_ranks + rank) * batch_size


def hand_step(workload: Workload, model: nn.Module, optimizer: Optimizer, start: int) -> None:
    """One step as a user writes it: the batch at ``start``, the mean loss, the update."""
    batch = workload.slice_batch(start, start + workload.batch_size)
    loss, num_targets = workload.loss(model, batch)
    (loss / num_targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
