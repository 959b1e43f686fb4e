"""Gradients across DP and TP: deferring their sync, scaling them, and their norm."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel as DDP


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
