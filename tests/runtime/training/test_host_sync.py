"""No host-device synchronization in a steady step: a step that does not publish, validate or
checkpoint never makes the host wait for the device (``pytest -k host_sync``); the torchrun
layouts are in ``test_host_sync_distributed.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sync_detector import FEATURES, HostSyncDetector, assert_as_pinned, watched_syncs


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.usefixtures("torch_private_apis")
def test_a_steady_step_host_syncs_only_where_pinned(tmp_path: Path, feature: str) -> None:
    assert_as_pinned(feature, watched_syncs(tmp_path, feature).detector.syncs)


class Wrapped(torch.Tensor):
    """A tensor subclass that runs each op on the tensor it wraps, as DTensor does on its local
    shard, and reads a value of it first: a sync inside the subclass's own dispatch."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        made.inner = inner
        return made

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        unwrapped = [a.inner if isinstance(a, Wrapped) else a for a in args]
        unwrapped[0].sum().item()
        return func(*unwrapped, **(kwargs or {}))


def test_the_host_sync_detector_sees_inside_a_tensor_subclass_and_counts_once() -> None:
    wrapped = Wrapped(torch.ones(3))
    with HostSyncDetector() as detector:
        torch.mul(wrapped, 2.0)
        wrapped.sum().item()
    assert len(detector.syncs) == 3, detector.syncs


def test_the_host_sync_detector_spares_only_numbers_put_on_the_host_on_purpose() -> None:
    with HostSyncDetector() as detector:
        torch.tensor([1.0, 2.0], dtype=torch.float64, device="cpu").tolist()
        torch.full((), 1.0, device=torch.device("cpu")).item()
    assert detector.syncs == []
    with HostSyncDetector() as detector:
        torch.tensor([1.0, 2.0]).tolist()
        torch.as_tensor(torch.ones(2), device="cpu").tolist()
        (torch.zeros(2, device="cpu") + 1).tolist()
    assert len(detector.syncs) == 3, detector.syncs
