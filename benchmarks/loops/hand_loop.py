"""The floor: the loop a user writes by hand, fed by slicing tensors already in memory."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

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
    starts = slice_starts(workload, num_ranks=num_ranks, rank=my_rank)
    for _ in range(plan.num_steps):
        hand_step(workload, model, optimizer, next(starts))
        timer.step_end()
    return timer.seconds_per_step()


def slice_starts(workload: Workload, *, num_ranks: int, rank: int) -> Iterator[int]:
    """The first example of this rank's batch of each step, endlessly: the ranks take
    consecutive batches, and an epoch ends where the data runs out for all of them. Computed
    ahead, so a step of the baseline pays only for ``next``."""
    batch_size = workload.batch_size
    steps_per_epoch = workload.num_examples() // (batch_size * num_ranks)
    return itertools.cycle(
        [(step_nr * num_ranks + rank) * batch_size for step_nr in range(steps_per_epoch)]
    )


def hand_step(workload: Workload, model: nn.Module, optimizer: Optimizer, start: int) -> None:
    """One step as a user writes it: the batch at ``start``, the mean loss, the update."""
    batch = workload.slice_batch(start, start + workload.batch_size)
    loss, num_targets = workload.loss(model, batch)
    (loss / num_targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hand_step_counted(
    workload: Workload, model: nn.Module, optimizer: Optimizer, start: int
) -> None:
    """One step normalized as the Trainer normalizes it: the gradients of the summed loss divided
    by the targets of every rank, whose sum an all-reduce started before the backward brings
    (so it needs a process group). :func:`hand_step` averages per-rank mean losses instead."""
    batch = workload.slice_batch(start, start + workload.batch_size)
    loss, num_targets = workload.loss(model, batch)
    total = torch.tensor([float(num_targets)], dtype=torch.float64)
    summing = dist.all_reduce(total, async_op=True)
    loss.backward()
    summing.wait()
    # DDP averaged the ranks' gradients: times the number of ranks, over all their targets.
    scale = dist.get_world_size() / total.item()
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(scale)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


HAND_STEPS: dict[str, Callable[[Workload, nn.Module, Optimizer, int], None]] = {
    "plain": hand_step,
    "counted": hand_step_counted,
}
"""The paired cases' hand-written steps by name: ``plain`` as a user writes it, ``counted``
normalized over the ranks as the Trainer does."""
