"""Sparse gradients (``nn.Embedding(sparse=True)``): reduced over the DP gang, normalized,
measured and clipped beside the dense ones.

DDP sums sparse gradients where it averages dense ones, and the fused unscale kernel that normalizes
dense gradients has no sparse kernel. So :func:`~runtime.parallel.wrapping.apply_data_parallel`
leaves the parameters of sparse embeddings out of DDP (see
:mod:`runtime.parallel.sparse_embeddings`), and each step reduces their gradients here: every rank
coalesces its gradient, the ranks gather each other's rows (indices and values, padded to the
longest), and each coalesces the gathered rows and divides by the gang size, which is what DDP does
to a dense gradient. Only the rows a step touched travel, never the whole table.
"""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from gangs import Gang


def reduce_sparse_gradient(grad: Tensor, gang: Gang) -> Tensor:
    """The mean of the coalesced sparse ``grad`` over ``gang``, coalesced."""
    indices, values = grad.indices(), grad.values()
    # The row count is a shape, known on the host: gathered in CPU tensors (gloo on CUDA), the
    # counts are read without waiting for the device.
    nnz = torch.tensor([indices.shape[1]], dtype=torch.int64, device="cpu")
    counts = torch.empty((gang.size, 1), dtype=torch.int64, device="cpu")
    gang.all_gather(counts, nnz)
    sizes = counts.flatten().tolist()
    longest = max(sizes)
    padded_indices = indices.new_zeros((indices.shape[0], longest))
    padded_indices[:, : indices.shape[1]] = indices
    padded_values = values.new_zeros((longest, *values.shape[1:]))
    padded_values[: values.shape[0]] = values
    all_indices = indices.new_empty((gang.size, *padded_indices.shape))
    all_values = values.new_empty((gang.size, *padded_values.shape))
    gang.all_gather(all_indices, padded_indices)
    gang.all_gather(all_values, padded_values)
    gathered = torch.sparse_coo_tensor(
        torch.cat([all_indices[r, :, :n] for r, n in enumerate(sizes)], dim=1),
        torch.cat([all_values[r, :n] for r, n in enumerate(sizes)]),
        grad.shape,
        check_invariants=False,
    ).coalesce()
    return _with_values(gathered, gathered.values() / gang.size)


def _with_values(grad: Tensor, values: Tensor) -> Tensor:
    """The coalesced sparse ``grad`` with its values replaced by ``values``."""
    return torch.sparse_coo_tensor(
        grad.indices(), values, grad.shape, is_coalesced=True, check_invariants=False
    )


@final
class SparseGradients:
    """The sparse gradients of a step; one per :class:`~runtime.training.gradients.Gradients`.

    Each is replaced by a coalesced one on :meth:`normalize` (optimizers such as ``SparseAdam``
    coalesce it anyway), so that its values hold each row once and their norm is the norm of
    the gradient.
    """

    def __init__(self, dp_gang: Gang | None) -> None:
        self._dp_gang = dp_gang if dp_gang is not None and dp_gang.size > 1 else None

    def normalize(self, params: list[Tensor], factor: float, non_finite: Tensor) -> None:
        """Coalesce, reduce over the DP gang, multiply by ``factor``; count a non-finite value
        into ``non_finite``."""
        for param in params:
            grad = param.grad
            assert grad is not None
            grad = grad.coalesce()
            if self._dp_gang is not None:
                grad = reduce_sparse_gradient(grad, self._dp_gang)
            values = grad.values() * factor if factor != 1.0 else grad.values()
            param.grad = _with_values(grad, values)
            bad = torch.isfinite(values).logical_not().any()
            non_finite.add_(bad.to(non_finite.device, torch.float32))

    @staticmethod
    def norms(params: list[Tensor]) -> list[Tensor]:
        """The 2-norm of each (coalesced) sparse gradient, its squares summed in float64 as the
        dense ones' are (``runtime.training.gradients._group_norm``)."""
        norms = []
        for param in params:
            assert param.grad is not None
            norms.append(torch.linalg.vector_norm(param.grad.values(), 2.0, dtype=torch.float64))
        return norms

    @staticmethod
    def clip(params: list[Tensor], clip_coef: Tensor) -> None:
        """Multiply each (coalesced) sparse gradient by ``clip_coef``."""
        for param in params:
            grad = param.grad
            assert grad is not None
            param.grad = _with_values(grad, grad.values() * clip_coef.to(grad.dtype))
