"""Workloads by the name a worker's command line gives."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.workloads.base import Workload
from benchmarks.workloads.lm import LmWorkload
from benchmarks.workloads.mlp import GpuMlpWorkload, MlpWorkload
from benchmarks.workloads.slow_data import SlowDataWorkload

_FACTORIES: dict[str, Callable[[], Workload]] = {
    "mlp": MlpWorkload,
    "lm": LmWorkload,
    "slow_data": SlowDataWorkload,
    "gpu_mlp": GpuMlpWorkload,
}
WORKLOAD_NAMES = tuple(_FACTORIES)


def make_workload(name: str) -> Workload:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"workload must be one of {', '.join(WORKLOAD_NAMES)}, but is {name!r} instead."
        ) from None
    return factory()
