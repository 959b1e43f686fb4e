"""What DDP's count-carrying communication hook does, on 2 ranks; rank 0 writes JSON.

Usage: ``count_carrier.py OUTPUT_FILE``. Checks the sums it carries against the exact ones,
its gradients against those of DDP without a hook (bit for bit), a backward that carries
nothing, and the models it declines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from gangs import setup_gangs
from runtime.training.step_totals import DdpCountCarrier
from tests.workers.leave import leave


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # Several buckets (a small cap), so bucket 0 is one of many.
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)).to(dtype)


def backward(model: nn.Module, rank: int) -> None:
    inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    model(inputs).pow(2).sum().backward()


def main(output: Path) -> None:
    gangs = setup_gangs()
    rank = gangs.dp.rank
    group = gangs.dp.as_process_group()
    results: dict[str, object] = {}

    carried = DDP(make_model(), process_group=group, bucket_cap_mb=0.02)
    plain = DDP(make_model(), process_group=group, bucket_cap_mb=0.02)
    carrier = DdpCountCarrier.attach(carried, gangs)
    assert carrier is not None
    # Counts beyond float32's 2**24, where a plain float32 sum would round.
    values = [2.0**35 + 7 + rank, 4095.0 + 3 * rank, float(rank), float(1 - rank)]
    for step in range(3):
        carrier.send(values)
        backward(carried, rank)
        backward(plain, rank)
        results[f"received_{step}"] = carrier.receive()
        results[f"same_grads_{step}"] = all(
            torch.equal(a.grad, b.grad)
            for a, b in zip(carried.parameters(), plain.parameters(), strict=True)
            if a.grad is not None and b.grad is not None
        )
        carried.zero_grad()
        plain.zero_grad()

    backward(carried, rank)
    results["received_without_send"] = carrier.receive()

    hooked = DDP(make_model(), process_group=group)
    hooked.register_comm_hook(group, allreduce_hook)
    results["declines"] = {
        "a plain module": DdpCountCarrier.attach(make_model(), gangs) is None,
        "a model with a hook": DdpCountCarrier.attach(hooked, gangs) is None,
        "bfloat16 gradients": DdpCountCarrier.attach(
            DDP(make_model(torch.bfloat16), process_group=group), gangs
        )
        is None,
    }
    if rank == 0:
        output.write_text(json.dumps(results))
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
