"""Gradients across DP and TP: deferring their sync, normalizing them, their norm, clipping.

DDP, FSDP2 and DTensor are imported only where a process group exists: without one nothing can
be any of them, and a single-process run spares importing them (seconds).

Two paths, chosen by :func:`gangs.torch_versions.private_apis_supported`: on the tested torch
versions, torch's private foreach kernels (``_amp_foreach_non_finite_check_and_unscale_``,
``_foreach_mul_``) do a group of gradients per op; on any other torch (or with
``TRAINKIT_TORCH_PRIVATE_APIS=public``), public per-tensor ops do the same arithmetic, one op
per gradient. Both make the same bits (see :func:`_scale_and_check`), and neither waits on the
device.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Final, final

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import TypeIs

from gangs import Gang, ReduceOperation
from gangs.torch_versions import private_apis_supported
from runtime.parallel.process_group import process_group_exists
from runtime.parallel.sparse_embeddings import sparse_parameters
from runtime.training.sparse_gradients import SparseGradients

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _is_dtensor(tensor: object) -> TypeIs[DTensor]:
    if not process_group_exists():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def gradient_sync_switch(model: Module) -> Callable[[bool], None] | None:
    """A switch for DP gradient reduction in ``model``'s next backwards: off while micro-batches
    accumulate, on for the last. None for a model that reduces nothing (neither DDP nor FSDP2).

    A switch, not a context manager: FSDP2 offers only the switch
    (``set_requires_gradient_sync``), so DDP gets one too (the flag its ``no_sync()`` sets).
    """
    if not process_group_exists():
        return None
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):

        def switch_ddp(enabled: bool) -> None:
            model.require_backward_grad_sync = enabled

        return switch_ddp
    if isinstance(model, FSDPModule):
        switch_fsdp: Callable[[bool], None] = model.set_requires_gradient_sync
        return switch_fsdp
    return None


def _parameter_groups(model: Module, sparse: list[Tensor]) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters of ``model`` but the ``sparse`` ones, grouped so that each group
    lives on one device mesh.

    DTensor ops need operands on one mesh: with FSDP2 x TP, TP-sharded parameters live on the
    2-D mesh and the others on the DP mesh, and with TP alone, plain tensors sit beside DTensors.
    """
    groups: dict[object, list[torch.nn.Parameter]] = {}
    sparse_ids = {id(p) for p in sparse}
    for param in model.parameters():
        if param.requires_grad and id(param) not in sparse_ids:
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
    gradients = Gradients(model)
    total_norm = gradients.norm()
    if max_norm is not None:
        gradients.clip(max_norm, total_norm)
    return total_norm


# The gradient dtypes the fused unscale kernel takes: it multiplies in float32 by a float32 factor
# and rounds once. For float32 those are the bits of ``_foreach_mul_`` with a Python float; for
# bfloat16 and float16 more exact ones (``_foreach_mul_`` rounds the factor to their dtype first).
# Float64 would lose the factor's precision, so it takes ``mul_`` with the Python float.
_FUSED_DTYPES: Final = (torch.float32, torch.bfloat16, torch.float16)


@final
class Gradients:
    """The gradients of a model's parameters, grouped by device mesh once: normalized, measured
    and clipped.

    The groups are found on the first step and kept: a step only collects the ``.grad`` of each
    group's parameters, without walking the module tree. The sparse gradients of embeddings
    with ``sparse=True`` are handled apart (:mod:`runtime.training.sparse_gradients`), reduced
    over ``dp_gang`` on :meth:`normalize`, and counted in the norm and clipping like the others.
    """

    def __init__(
        self,
        model: Module,
        *,
        dp_gang: Gang | None = None,
        pp_gang: Gang | None = None,
        uncounted: Collection[Tensor] = (),
    ) -> None:
        self._model = model
        # Normalized and clipped, but left out of the norm: a pipeline stage's copy of a tied
        # weight whose other copy, on another rank, counts it.
        self._uncounted = {id(p) for p in uncounted}
        # Under pipeline parallelism each rank holds other parameters: the norm sums the squares
        # of every stage's (one all-reduce over the PP gang).
        self._pp_gang = pp_gang if pp_gang is not None and pp_gang.size > 1 else None
        self._private = private_apis_supported()
        self._sparse = SparseGradients(dp_gang)
        self._sparse_params: list[Tensor] = []
        # Each group's parameters, whether the group is plain, whether its local tensors take
        # the fused unscale kernel, and whether the norm counts it: found on the first step.
        self._groups: list[tuple[list[torch.nn.Parameter], bool, bool, bool]] | None = None
        self._device: torch.device | None = None
        self._non_finite: Tensor | None = None
        self._inverse: Tensor | None = None
        self._factor = 1.0

    def _grads(self, *, counted_only: bool = False) -> list[tuple[list[Tensor], bool, bool]]:
        """Each group's gradients (groups without any left out), whether the group is plain, and
        whether its local tensors take the fused unscale kernel; ``counted_only``: the groups
        the norm counts."""
        if self._groups is None:
            self._sparse_params = [
                p for p in sparse_parameters(self._model).values() if p.requires_grad
            ]
            groups = [
                part
                for group in _parameter_groups(self._model, self._sparse_params)
                for counted in (True, False)
                if (part := [p for p in group if (id(p) not in self._uncounted) == counted])
            ]
            firsts = [group[0] for group in groups] + self._sparse_params
            self._device = _local(firsts[0]).device if firsts else None
            self._groups = [
                (
                    group,
                    _is_plain(group),
                    self._private and _is_fusable(group, self._device),
                    id(group[0]) not in self._uncounted,
                )
                for group in groups
            ]
        grouped = []
        for group, plain, fused, counted in self._groups:
            grads = [grad for p in group if (grad := p.grad) is not None]
            if grads and (counted or not counted_only):
                grouped.append((grads, plain, fused))
        return grouped

    def _sparse_grads(self) -> list[Tensor]:
        """The sparse parameters that have a gradient this step (after :meth:`_grads`)."""
        return [p for p in self._sparse_params if p.grad is not None]

    def normalize(self, factor: float) -> Tensor | None:
        """Multiply the gradients by ``factor``; return this rank's non-finite flag (None if
        there are no gradients).

        The flag is one tensor for the whole run, on the device: it turns non-zero at the first
        NaN or infinite gradient and stays so, and nothing here waits for it. Every gradient is
        read once, where it can be in one fused kernel that multiplies and checks together (the
        one fp16 loss scaling unscales with): a step costs that kernel, plus a fill when the
        factor changed, where ``_foreach_mul_`` and a norm would dispatch once per tensor each.
        """
        grouped = self._grads()
        sparse = self._sparse_grads()
        if not grouped and not sparse:
            return None
        if self._non_finite is None or self._inverse is None:
            # float32 whatever the default dtype: the fused kernel takes nothing else.
            self._non_finite = torch.zeros((), dtype=torch.float32, device=self._device)
            self._inverse = torch.full((), factor, dtype=torch.float32, device=self._device)
        elif factor != self._factor:
            self._inverse.fill_(factor)
        self._factor = factor
        for grads, plain, fused in grouped:
            local = grads if plain else [_local(g) for g in grads]
            if fused:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    local, self._non_finite, self._inverse
                )
            else:
                _scale_and_check(local, factor, self._inverse, self._non_finite)
        if sparse:
            self._sparse.normalize(sparse, factor, self._non_finite)
        return self._non_finite

    def clear_non_finite(self) -> None:
        """Lower the non-finite flag: the weights it warned of were replaced (a rollback)."""
        if self._non_finite is not None:
            self._non_finite.zero_()

    def norm(self) -> Tensor:
        """The total 2-norm of the gradients, in float32 (a collective for sharded gradients,
        none for plain and DDP ones), within 1e-6 of the float64 norm in every layout.

        Squares are summed in float64 (see :func:`_group_norm`); only the result is rounded to
        float32, the dtype clipping, the loss scaler and the metrics take."""
        grouped = self._grads(counted_only=True)
        norms = [_group_norm(grads, self._private and plain) for grads, plain, _ in grouped]
        norms += self._sparse.norms(self._sparse_grads())
        if self._pp_gang is not None:
            return self._pipeline_norm(norms)
        if not norms:
            return torch.zeros((), dtype=torch.float32)
        # With one group, sqrt(norm ** 2) is norm exactly (binary floating point), so skip the ops.
        total = norms[0] if len(norms) == 1 else torch.stack([n**2 for n in norms]).sum().sqrt()
        return total.float()

    def _pipeline_norm(self, norms: list[Tensor]) -> Tensor:
        """The norm over every stage: this rank's squares summed over the PP gang, in float64."""
        assert self._pp_gang is not None
        device = self._pp_gang.device
        squares = (
            torch.stack([n.to(device) ** 2 for n in norms]).sum()
            if norms
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        self._pp_gang.all_reduce(squares, ReduceOperation.SUM)
        return squares.sqrt().float()

    def clip(self, max_norm: float, total_norm: Tensor) -> None:
        """Scale the gradients down so that their norm, ``total_norm`` now, is at most
        ``max_norm``."""
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for grads, _, _ in self._grads():
            coef = clip_coef.to(grads[0].dtype)
            if self._private:
                torch._foreach_mul_(grads, coef)
                continue
            # The local shard: scaling it scales the DTensor, without DTensor's dispatch per op.
            for grad in grads:
                _local(grad).mul_(coef)
        self._sparse.clip(self._sparse_grads(), clip_coef)


def _local(tensor: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _scale_and_check(
    tensors: list[Tensor], factor: float, inverse: Tensor, non_finite: Tensor
) -> None:
    """Multiply each of ``tensors`` by ``factor`` and count a non-finite one into ``non_finite``,
    one tensor at a time: the public path, and the rare layouts (float64, or mixed devices) on
    the private one.

    A tensor the fused kernel would take is multiplied as it does, in float32 by ``inverse``
    (``factor`` in float32) and rounded once: the same bits. The check reads the product, so a
    finite gradient that a factor above 1 overflows counts too, where the fused kernel checks
    its input; with a factor of at most 1 the flags agree. The flag only grows on the device.
    """
    for tensor in tensors:
        if factor == 1.0:
            pass
        elif tensor.device != inverse.device or tensor.dtype not in _FUSED_DTYPES:
            tensor.mul_(factor)
        elif tensor.dtype == torch.float32:
            tensor.mul_(inverse)
        else:
            tensor.copy_(tensor.float().mul_(inverse))
        bad = torch.isfinite(tensor).logical_not().any()
        non_finite.add_(bad.to(non_finite.device, torch.float32))


def _is_fusable(group: list[torch.nn.Parameter], device: torch.device | None) -> bool:
    """Whether the fused unscale kernel takes the local gradients of ``group``: all on ``device``
    (the flag's), and of the ``_FUSED_DTYPES``."""
    return all(_local(p).device == device and p.dtype in _FUSED_DTYPES for p in group)


def _group_norm(grads: list[Tensor], foreach: bool) -> Tensor:
    """The 2-norm of one group's gradients, in float64; ``foreach``: the group is plain and the
    private ``_foreach_norm`` may take it in one call.

    Each tensor's squares are summed in float64: a float32 sum over a 4096 x 64 gradient loses
    some 3.5e-5 of its norm (``torch.nn.utils.get_total_norm``'s), so layouts that sum different
    shards would publish, and clip with, norms that differ by that much. A DTensor's norm is
    Partial over the mesh dims it is sharded on and Replicate over the others, so
    ``full_tensor()`` adds each shard once and a replica never twice, in float64 too.
    """
    if foreach:
        norms = list(torch._foreach_norm(grads, 2.0, dtype=torch.float64))
    else:
        norms = [torch.linalg.vector_norm(grad, 2.0, dtype=torch.float64) for grad in grads]
    norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    full: Tensor = norm.full_tensor() if _is_dtensor(norm) else norm
    return full
