"""Wrap a model for data and tensor parallelism over the gangs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel as DDP

from gangs import Gangs

DataParallelKind = Literal["ddp", "fsdp"]


def apply_tensor_parallel(model: Module, gangs: Gangs, plan: Mapping[str, ParallelStyle]) -> Module:
    """Shard the submodules named in ``plan`` over the TP gang; a no-op when TP is off."""
    if gangs.tp.size == 1:
        return model
    return parallelize_module(model, gangs.device_mesh["tp"], dict(plan))


def apply_data_parallel(
    model: Module,
    gangs: Gangs,
    *,
    kind: DataParallelKind = "ddp",
    fsdp_units: tuple[type[Module], ...] = (),
) -> Module:
    """Replicate (DDP) or shard (FSDP2) ``model`` over the DP gang; a no-op when DP is off.

    With FSDP2, each submodule whose type is in ``fsdp_units`` becomes its own shard unit (its
    parameters are gathered only around its own forward and backward), then the whole model.
    Apply tensor parallelism first; only FSDP2 composes with it.
    """
    if kind not in ("ddp", "fsdp"):
        raise ValueError(f"kind must be 'ddp' or 'fsdp', but is '{kind}' instead.")
    if gangs.dp.size == 1:
        return model
    if kind == "fsdp":
        dp_mesh = gangs.device_mesh["dp"]
        for module in model.modules():
            if isinstance(module, fsdp_units):
                fully_shard(module, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model
    if gangs.tp.size > 1:
        # DDP does not handle DTensor parameters (their state dict entries are lost).
        raise ValueError(
            "DDP does not compose with tensor parallelism. Use kind='fsdp' (FSDP2) when the TP "
            f"gang has more than one process (it has {gangs.tp.size})."
        )
    device_ids = [gangs.dp.device.index] if gangs.dp.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, process_group=gangs.dp.as_process_group())


def unwrap_model(model: Module) -> Module:
    """The user's module inside a DDP wrapper (FSDP2 and TP modify the module in place)."""
    return model.module if isinstance(model, DDP) else model
