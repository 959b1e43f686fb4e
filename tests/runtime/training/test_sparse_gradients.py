"""Reducing sparse gradients over the DP gang: the mean of the ranks' rows, counted on the host."""

from __future__ import annotations

import torch

from runtime.training.sparse_gradients import reduce_sparse_gradient
from tests.conftest import TwinRanksGang


def test_the_row_counts_are_gathered_on_the_cpu_and_the_rows_on_the_device() -> None:
    """The counts are shapes the host knows: gathered in CPU tensors (gloo), read without
    waiting for the GPU. Only the rows travel on the gradient's device."""
    grad = torch.sparse_coo_tensor(
        torch.tensor([[4, 1, 4]]),
        torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
        (6, 2),
        check_invariants=True,
    ).coalesce()
    gang = TwinRanksGang(torch.device("cuda", 0))
    reduced = reduce_sparse_gradient(grad, gang)
    # Two ranks with the same rows: the mean is the gradient itself.
    torch.testing.assert_close(reduced.to_dense(), grad.to_dense())
    assert reduced.is_coalesced()
    assert gang.collective_devices == [torch.device("cpu"), grad.device, grad.device]
