"""What the Trainer measures between two publishes, and the train metrics it publishes."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, final

import torch

from gangs import Gang, ReduceOperation
from runtime.train_state import check_state_keys
from runtime.train_step import StepOutput
from units import MetricBag

_WINDOW_KEYS = (
    "loss_sum",
    "grad_norm_sum",
    "num_local_targets",
    "num_targets",
    "num_examples",
    "num_steps",
)


@final
class TrainMetrics:
    """Sums the steps of a publish window on the device; :meth:`compute` reads them once.

    Only :meth:`compute` syncs with the device and communicates: one all-reduce of the loss sum
    and target count over the DP gang, and the unit's metrics merged over it.
    """

    def __init__(self, *, unit_metrics: MetricBag, dp_gang: Gang) -> None:
        self._unit_metrics = unit_metrics
        self._dp_gang = dp_gang
        self._device = dp_gang.device
        self.reset()

    def reset(self) -> None:
        """Start an empty window (the unit's persistent metrics carry on)."""
        self._loss_sum = torch.zeros((), device=self._device, dtype=torch.float64)
        self._grad_norm_sum = torch.zeros((), device=self._device, dtype=torch.float32)
        self._num_local_targets = 0
        self._num_targets = 0.0
        self._num_examples = 0.0
        self._num_steps = 0
        self._data_wait_time = 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        self._start = time.perf_counter()

    @property
    def num_steps(self) -> int:
        """The steps in the window, not published yet."""
        return self._num_steps

    def add_step(self, output: StepOutput) -> None:
        self._loss_sum += output.loss_sum
        self._grad_norm_sum += output.grad_norm.detach().to(self._device, torch.float32)
        self._num_local_targets += output.num_targets
        self._num_targets += output.total_targets
        self._num_examples += output.total_examples
        self._num_steps += 1

    def add_data_wait(self, seconds: float) -> None:
        self._data_wait_time += seconds

    def compute(self, extra_values: Mapping[str, Any]) -> dict[str, Any]:
        """The window's values, then ``extra_values``, then the unit's metrics over the DP gang;
        the window starts anew after. Every rank of the DP gang must call it.
        """
        sums = torch.stack(
            [
                self._loss_sum,
                torch.tensor(
                    float(self._num_local_targets), device=self._device, dtype=torch.float64
                ),
            ]
        )
        self._dp_gang.all_reduce(sums, ReduceOperation.SUM)
        loss_sum, num_targets = sums.tolist()
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        steps = max(self._num_steps, 1)
        values: dict[str, Any] = {
            "loss": loss_sum / num_targets if num_targets else math.nan,
            "grad_norm": self._grad_norm_sum.item() / steps,
            "num_targets": self._num_targets,
            "targets_per_second": self._num_targets / elapsed,
            "batch_size": self._num_examples / steps,
            "data_wait_time": self._data_wait_time,
            "num_steps": self._num_steps,
            **extra_values,
        }
        values.update(self._unit_metrics.sync_and_compute(self._dp_gang))
        self._unit_metrics.reset_non_persistent_metrics()
        self.reset()
        return values

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": {
                "loss_sum": self._loss_sum.cpu(),
                "grad_norm_sum": self._grad_norm_sum.cpu(),
                "num_local_targets": self._num_local_targets,
                "num_targets": self._num_targets,
                "num_examples": self._num_examples,
                "num_steps": self._num_steps,
            },
            "unit_metrics": self._unit_metrics.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(state, {"window", "unit_metrics"}, what="train_metrics")
        window = state["window"]
        check_state_keys(window, _WINDOW_KEYS, what="train_metrics window")
        self._loss_sum = window["loss_sum"].to(self._device)
        self._grad_norm_sum = window["grad_norm_sum"].to(self._device)
        self._num_local_targets = int(window["num_local_targets"])
        self._num_targets = float(window["num_targets"])
        self._num_examples = float(window["num_examples"])
        self._num_steps = int(window["num_steps"])
        self._unit_metrics.load_state_dict(state["unit_metrics"])
