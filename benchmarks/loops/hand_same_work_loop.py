"""The hand-written loop doing per step what the Trainer must: the floor of the Trainer's cost.

On top of the hand-written loop it reads shuffled batches (the dataset's tensors gathered in a
shuffled order once, then sliced, as a user would write it), and normalizes the gradients of the
summed loss after the backward (the Trainer cannot divide the loss before it: under DP the target
total arrives during the backward) in the one fused kernel that also raises the flag of a NaN or
infinite gradient, which ``nan_policy`` checks at publish. It keeps the loss on the device for the
metric window. The gradient norm is left out, as the Trainer measures it only on the steps that
publish it (none of the timed ones). What the Trainer costs beyond this loop is its own
bookkeeping.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from benchmarks.loops.hand_loop import slice_starts
from benchmarks.loops.registry import LoopOptions
from benchmarks.probe import StepTimer, world_size
from benchmarks.workloads import StepPlan, Workload


def run(workload: Workload, plan: StepPlan, options: LoopOptions) -> float:
    del options
    if world_size() != 1:
        raise ValueError("The hand-written loop with the Trainer's work runs in one process only.")
    dataset = workload.dataset()
    if not isinstance(dataset, TensorDataset):
        raise ValueError("The hand-written loop with the Trainer's work needs a TensorDataset.")
    model = workload.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    order = torch.randperm(workload.num_examples(), generator=torch.Generator().manual_seed(0))
    timer = StepTimer(num_warmup=plan.num_warmup, num_steps=plan.num_steps)
    batch_size = workload.batch_size
    starts = slice_starts(workload, num_ranks=1, rank=0)
    window: list[Tensor] = []
    non_finite = torch.zeros(())
    inverse, factor = torch.ones(()), 1.0
    shuffled = [tensor.index_select(0, order) for tensor in dataset.tensors]
    for _ in range(plan.num_steps):
        start = next(starts)
        batch = [tensor[start : start + batch_size] for tensor in shuffled]
        loss, num_targets = workload.loss(model, batch)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        if 1.0 / num_targets != factor:
            factor = 1.0 / num_targets
            inverse.fill_(factor)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, non_finite, inverse)
        window.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.step_end()
    return timer.seconds_per_step()
