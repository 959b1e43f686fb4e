"""Gradients across DP and TP: deferring their sync, scaling them, and their norm.

DDP, FSDP2 and DTensor are looked up only once something imported them: a model that uses none
of them never needs them, and importing them costs a second.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final, final

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import TypeIs

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_NO_SYNC_NEEDED: Final = contextlib.nullcontext()


def _loaded_class(module: str, name: str) -> Any:
    """``module.name`` if ``module`` was imported already, else None: nothing is an instance of
    a class that was never imported."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def _is_dtensor(tensor: object) -> TypeIs[DTensor]:
    dtensor = _loaded_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def skip_gradient_sync(model: Module, skip: bool) -> contextlib.AbstractContextManager[Any]:
    """Defer DP gradient reduction while ``skip`` (all but the last accumulated micro-batch)."""
    if not skip:
        return _NO_SYNC_NEEDED
    ddp = _loaded_class("torch.nn.parallel", "DistributedDataParallel")
    if ddp is not None and isinstance(model, ddp):
        return model.no_sync()  # type: ignore[no-any-return]
    fsdp = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    if fsdp is not None and isinstance(model, fsdp):
        return _fsdp_no_sync(model)
    return _NO_SYNC_NEEDED


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gradient_groups(model: Module) -> list[list[Tensor]]:
    """The gradients of ``model``, grouped so that each group lives on one device mesh.

    DTensor ops need operands on one mesh: with FSDP2 x TP, TP-sharded parameters live on the
    2-D mesh and the others on the DP mesh, and with TP alone, plain tensors sit beside DTensors.
    """
    groups: dict[object, list[Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad
            groups.setdefault(grad.device_mesh if _is_dtensor(grad) else None, []).append(grad)
    return list(groups.values())


def scale_gradients(model: Module, scale: float) -> None:
    for group in gradient_groups(model):
        torch._foreach_mul_(group, scale)


def clip_gradient_norm(model: Module, max_norm: float | None) -> Tensor:
    """Return the total gradient norm of ``model`` and clip to ``max_norm`` if given.

    Works for plain, DDP, FSDP2 and TP parameters alike: sharded (DTensor) gradients are reduced
    to their full norm, replicated ones count once. The norm stays on the device (no host sync).
    """
    return _clip(gradient_groups(model), max_norm)


def _clip(groups: list[list[Tensor]], max_norm: float | None) -> Tensor:
    if not groups:
        return torch.zeros(())
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm(group)
        if _is_dtensor(norm):
            norm = norm.full_tensor()
        norms.append(norm.float())
    # With one group, sqrt(norm ** 2) is norm exactly (binary floating point), so skip the ops.
    total_norm = norms[0] if len(norms) == 1 else torch.stack([n**2 for n in norms]).sum().sqrt()
    if max_norm is not None:
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for group in groups:
            torch._foreach_mul_(group, clip_coef.to(group[0].dtype))
    return total_norm


@final
class Gradients:
    """The gradients of a model's parameters, grouped by device mesh once, scaled and clipped.

    The groups are found on the first step and kept: a step only collects the ``.grad`` of each
    group's parameters, without walking the module tree.
    """

    def __init__(self, model: Module) -> None:
        self._model = model
        self._groups: list[list[torch.nn.Parameter]] | None = None

    def _grads(self) -> list[list[Tensor]]:
        if self._groups is None:
            groups: dict[object, list[torch.nn.Parameter]] = {}
            for param in self._model.parameters():
                if param.requires_grad:
                    mesh = param.device_mesh if _is_dtensor(param) else None
                    groups.setdefault(mesh, []).append(param)
            self._groups = list(groups.values())
        grads = [[p.grad for p in group if p.grad is not None] for group in self._groups]
        return [group for group in grads if group]

    def scale(self, factor: float) -> None:
        if factor != 1.0:
            for group in self._grads():
                torch._foreach_mul_(group, factor)

    def clip(self, max_norm: float | None) -> Tensor:
        """Return the total norm and clip to ``max_norm`` if given (see :func:`clip_gradient_norm`)."""
        return _clip(self._grads(), max_norm)
