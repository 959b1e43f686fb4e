"""Wrap a model for data and tensor parallelism over the gangs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel as DDP

from gangs import Gangs

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# FSDP2 and tensor parallelism import DTensor, which takes a second: each function imports what
# it applies, so a run without them never pays for it.

DataParallelKind = Literal["ddp", "fsdp", "hsdp"]


def apply_tensor_parallel(model: Module, gangs: Gangs, plan: Mapping[str, ParallelStyle]) -> Module:
    """Shard the submodules named in ``plan`` over the TP gang; a no-op when TP is off."""
    if gangs.tp.size == 1:
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, gangs.tp_mesh, dict(plan))


def apply_data_parallel(
    model: Module,
    gangs: Gangs,
    *,
    kind: DataParallelKind = "ddp",
    fsdp_units: tuple[type[Module], ...] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> Module:
    """Replicate (DDP), shard (FSDP2) or shard-and-replicate (HSDP) ``model`` over the DP gang.

    A no-op when DP is off. With FSDP2 and HSDP, each submodule whose type is in ``fsdp_units``
    becomes its own shard unit (its parameters are gathered only around its own forward and
    backward), then the whole model. HSDP shards within ``dp_shard`` and replicates across
    ``dp_replicate`` (``setup_gangs(dp_shard_size=...)``). Apply tensor parallelism first; only
    FSDP2 and HSDP compose with it.

    ``param_dtype`` and ``reduce_dtype`` are FSDP2's mixed precision (``MixedPrecisionPolicy``):
    the dtype parameters are gathered in and the forward and backward compute in, and the dtype
    gradients are reduced in. The sharded parameters and the optimizer stay in their own dtype.
    """
    if kind not in ("ddp", "fsdp", "hsdp"):
        raise ValueError(f"kind must be 'ddp', 'fsdp' or 'hsdp', but is '{kind}' instead.")
    if kind == "ddp" and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError(
            f"param_dtype ({param_dtype}) and reduce_dtype ({reduce_dtype}) are FSDP2 options, "
            "but kind is 'ddp'. Use kind='fsdp' or 'hsdp', or autocast (Trainer amp=True)."
        )
    if gangs.dp.size == 1:
        return model
    if kind != "ddp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = gangs.hsdp_mesh if kind == "hsdp" else gangs.dp_mesh
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for module in model.modules():
            if isinstance(module, fsdp_units):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
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
