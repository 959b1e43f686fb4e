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


def loaded_class(module: str, name: str) -> Any:
    """``module.name`` if ``module`` was imported already, else None: nothing is an instance of
    a class that was never imported."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def _is_dtensor(tensor: object) -> TypeIs[DTensor]:
    dtensor = loaded_class("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def skip_gradient_sync(model: Module, skip: bool) -> contextlib.AbstractContextManager[Any]:
    """Defer DP gradient reduction while ``skip`` (all but the last accumulated micro-batch)."""
    if not skip:
        return _NO_SYNC_NEEDED
    ddp = loaded_class("torch.nn.parallel", "DistributedDataParallel")
    if ddp is not None and isinstance(model, ddp):
        return model.no_sync()  # type: ignore[no-any-return]
    fsdp = loaded_class("torch.distributed.fsdp", "FSDPModule")
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


def _parameter_groups(model: Module) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters of ``model``, grouped so that each group lives on one device mesh.

    DTensor ops need operands on one mesh: with FSDP2 x TP, TP-sharded parameters live on the
    2-D mesh and the others on the DP mesh, and with TP alone, plain tensors sit beside DTensors.
    """
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.requires_grad:
            mesh = param.device_mesh if _is_dtensor(param) else None
            groups.setdefault(mesh, []).append(param)
    return list(groups.values())


def _is_plain(group: list[torch.nn.Parameter]) -> bool:
    """Whether ``group`` is plain tensors of one device and dtype; autograd gives a gradient the
    device and dtype of its parameter, so their gradients are too."""
    first = group[0]
    return not _is_dtensor(first) and all(
        p.device == first.device and p.dtype == first.dtype for p in group
    )


def clip_gradient_norm(model: Module, max_norm: float | None) -> Tensor:
    """Return the total gradient norm of ``model`` and clip to ``max_norm`` if given.

    Works for plain, DDP, FSDP2 and TP parameters alike: sharded (DTensor) gradients are reduced
    to their full norm, replicated ones count once. The norm stays on the device (no host sync).
    """
    return Gradients(model).clip(max_norm)


@final
class Gradients:
    """The gradients of a model's parameters, grouped by device mesh once, scaled and clipped.

    The groups are found on the first step and kept: a step only collects the ``.grad`` of each
    group's parameters, without walking the module tree.
    """

    def __init__(self, model: Module) -> None:
        self._model = model
        self._groups: list[list[torch.nn.Parameter]] | None = None
        self._plain: list[bool] = []

    def _grads(self) -> list[tuple[list[Tensor], bool]]:
        """Each group's gradients (groups without any left out), and whether the group is plain."""
        if self._groups is None:
            self._groups = _parameter_groups(self._model)
            self._plain = [_is_plain(group) for group in self._groups]
        grouped = []
        for group, plain in zip(self._groups, self._plain, strict=True):
            grads = [p.grad for p in group if p.grad is not None]
            if grads:
                grouped.append((grads, plain))
        return grouped

    def clip(self, max_norm: float | None) -> Tensor:
        """Return the total norm and clip to ``max_norm`` if given (see :func:`clip_gradient_norm`)."""
        return self.scale_and_clip(1.0, max_norm)

    def scale_and_clip(self, factor: float, max_norm: float | None) -> Tensor:
        """Multiply the gradients by ``factor``; then return their total norm, and clip them to
        ``max_norm`` if given."""
        grouped = self._grads()
        if not grouped:
            return torch.zeros(())
        if factor != 1.0:
            for grads, _ in grouped:
                torch._foreach_mul_(grads, factor)
        norms = [_group_norm(grads, plain) for grads, plain in grouped]
        # With one group, sqrt(norm ** 2) is norm exactly (binary floating point), so skip the ops.
        total_norm = (
            norms[0] if len(norms) == 1 else torch.stack([n**2 for n in norms]).sum().sqrt()
        )
        if max_norm is not None:
            clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
            for grads, _ in grouped:
                torch._foreach_mul_(grads, clip_coef.to(grads[0].dtype))
        return total_norm


def _group_norm(grads: list[Tensor], plain: bool) -> Tensor:
    """The 2-norm of one group's gradients, in float32 or wider."""
    if plain:
        # The ops get_total_norm runs for tensors of one device and dtype, so the same bits,
        # without its grouping and checks: these cost more than the norm on a small model.
        norm: Tensor = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        # .float() of a float32 tensor is the tensor itself, but its dispatch costs more than this.
        return norm if norm.dtype == torch.float32 else norm.float()
    norm = torch.nn.utils.get_total_norm(grads)
    full: Tensor = norm.full_tensor() if _is_dtensor(norm) else norm
    return full.float()
