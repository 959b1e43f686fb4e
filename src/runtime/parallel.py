"""Wrap a model for data and tensor parallelism over the gangs, and clip its gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
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


@contextlib.contextmanager
def skip_gradient_sync(model: Module, skip: bool) -> Iterator[None]:
    """Defer DP gradient reduction while ``skip`` (all but the last accumulated micro-batch)."""
    if not skip:
        yield
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def gradient_groups(model: Module) -> list[list[Tensor]]:
    """The gradients of ``model``, grouped so that each group lives on one device mesh.

    DTensor ops need operands on one mesh: with FSDP2 x TP, TP-sharded parameters live on the
    2-D mesh and the others on the DP mesh, and with TP alone, plain tensors sit beside DTensors.
    """
    groups: dict[object, list[Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad
            groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(
                grad
            )
    return list(groups.values())


def scale_gradients(model: Module, scale: float) -> None:
    for group in gradient_groups(model):
        torch._foreach_mul_(group, scale)


def clip_gradient_norm(model: Module, max_norm: float | None) -> Tensor:
    """Return the total gradient norm of ``model`` and clip to ``max_norm`` if given.

    Works for plain, DDP, FSDP2 and TP parameters alike: sharded (DTensor) gradients are reduced
    to their full norm, replicated ones count once. The norm stays on the device (no host sync).
    """
    groups = gradient_groups(model)
    if not groups:
        return torch.zeros(())
    squares = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm(group)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total_norm = torch.stack(squares).sum().sqrt()
    if max_norm is not None:
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for group in groups:
            torch._foreach_mul_(group, clip_coef.to(group[0].dtype))
    return total_norm
