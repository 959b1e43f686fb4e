"""What the Trainer measures between two publishes, and the train metrics it publishes."""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, final

import torch
from torch import Tensor

from checkpoint.state_keys import check_state_keys
from gangs import Gangs, ReduceOperation
from runtime.metrics.device_peaks import matmul_precision, peak_flops
from trainkit_utils.arguments import check_positive
from units import MetricBag

log = logging.getLogger(__name__)

_WINDOW_KEYS = (
    "loss_sum",
    "grad_norm_sum",
    "num_grad_norms",
    "num_local_targets",
    "num_targets",
    "num_examples",
    "num_steps",
    "num_skipped_steps",
)


@final
@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutput:
    """What one step measured; tensors stay on the device, so reading them is left to publish."""

    step_nr: int
    """The number of the step."""
    losses: list[Tensor]
    """This rank's summed loss of each micro-batch."""
    num_targets: int
    """This rank's targets (or micro-batches, for a unit that returns mean losses)."""
    total_targets: float
    """The targets of the whole DP gang: the normalizer of the step."""
    total_examples: float
    """The examples of the whole DP gang."""
    grad_norm: Tensor | None
    """The gradient norm before clipping, on the steps that measure it (see
    :meth:`~runtime.training.step.TrainStep.__call__`)."""
    non_finite_gradients: Tensor | None
    """This rank's flag, one tensor for the run: non-zero since the first NaN or infinite
    gradient (None without gradients)."""
    stop_requested: bool
    """Whether any rank asked to stop (a signal) before this step."""
    applied: bool = True
    """False when the step was skipped (fp16 overflow, or a non-finite value with
    ``nan_policy="skip"``): the weights are as before it."""


class NonFiniteCheck(Protocol):
    """What :class:`TrainMetrics` asks of the guard against non-finite values
    (:class:`~runtime.training.non_finite.NonFiniteGuard`) when it checks a window."""

    @property
    def skips(self) -> bool:
        """Whether steps are checked on the host and skipped (``nan_policy="skip"``)."""
        ...

    def raise_if_non_finite(
        self,
        *,
        losses: Sequence[tuple[int, Tensor]],
        gradient_flag: Tensor | None,
        unchecked_steps: tuple[int, int] | None,
        num_targets: Mapping[int, int] | None = None,
    ) -> None:
        """Stop every rank if a loss or gradient of the window was not finite."""
        ...


@final
@dataclass(frozen=True)
class Throughput:
    """What model FLOPs utilization (``mfu``) needs; both or neither.

    ``flops_per_target``: the FLOPs of forward and backward per target, about ``6 * N`` for a
    dense transformer of ``N`` parameters (plus ``12 * layers * dim * seq_len`` for attention).
    ``device_peak_flops``: the device's peak for the training dtype, from its data sheet (e.g.
    312e12 for an A100 in bf16).
    """

    flops_per_target: float | None = None
    device_peak_flops: float | None = None

    def __post_init__(self) -> None:
        check_positive("flops_per_target", self.flops_per_target)
        check_positive("device_peak_flops", self.device_peak_flops)
        if (self.flops_per_target is None) != (self.device_peak_flops is None):
            raise ValueError(
                "mfu needs both flops_per_target and device_peak_flops; give both or neither."
            )

    @staticmethod
    def for_device(
        flops_per_target: float | None,
        device_peak_flops: float | None,
        *,
        device_name: str | None,
        num_parameters: int,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> Throughput:
        """What ``mfu`` needs, with the gaps filled where the device is known.

        On a device of :data:`~runtime.metrics.device_peaks.PEAK_FLOPS` (``device_name``, None
        for a CPU), a missing ``device_peak_flops`` is its dense peak in the precision a model
        computing in ``compute_dtype`` runs its matmuls in (float32 counts as TF32 when torch
        allows TF32), and a missing ``flops_per_target`` is ``6 * num_parameters`` (forward and
        backward of a dense transformer, attention left out). On a CUDA device of unknown peak,
        ``mfu`` is not published unless ``device_peak_flops`` is given; on a CPU both are the
        caller's to give.
        """
        if device_peak_flops is None and device_name is not None:
            precision = matmul_precision(compute_dtype)
            device_peak_flops = peak_flops(device_name, precision)
            if device_peak_flops is None:
                log.warning(
                    "mfu is not published: the %s peak FLOP/s of a %s is not known. Give the "
                    "Trainer device_peak_flops (its dense peak in the training precision) to "
                    "publish it.",
                    precision,
                    device_name,
                )
                return Throughput()
            if flops_per_target is None:
                flops_per_target = 6.0 * num_parameters
        return Throughput(flops_per_target, device_peak_flops)

    def mfu(self, targets_per_second_per_device: float) -> float | None:
        if self.flops_per_target is None or self.device_peak_flops is None:
            return None
        return targets_per_second_per_device * self.flops_per_target / self.device_peak_flops


@final
@dataclass(frozen=True)
class _WindowCounts:
    """What a window counts: its own steps, plus what a loaded state carried into it."""

    num_local_targets: int = 0
    num_targets: float = 0.0
    num_examples: float = 0.0
    num_steps: int = 0
    num_skipped_steps: int = 0
    num_grad_norms: int = 0


@final
class TrainMetrics:
    """Keeps the steps of a publish window; :meth:`compute` reads them once.

    A step only appends its output (its loss tensors, counts and, on the steps that measure it,
    its gradient norm) to the window, and keeps the run's non-finite-gradient flag: no device
    work, no sync. :meth:`check_finite` (at a publish, and before a checkpoint) checks the
    window for non-finite values and folds it into running sums, in step order, so a resumed
    window sums exactly as an uninterrupted one. :meth:`compute` makes the publish's
    collectives: an all-reduce of the loss sum and target count over the DP gang, one of the
    non-finite check and peak memory over the root gang, and the unit's metrics merged over the
    DP gang.
    """

    def __init__(
        self,
        *,
        unit_metrics: MetricBag,
        gangs: Gangs,
        guard: NonFiniteCheck,
        throughput: Throughput = Throughput(),
    ) -> None:
        self._unit_metrics = unit_metrics
        self._gangs = gangs
        self._device = gangs.dp.device
        self._guard = guard
        self._throughput = throughput
        self._gradient_flag: Tensor | None = None
        self.reset()

    def reset(self) -> None:
        """Start an empty window (the unit's persistent metrics carry on)."""
        # The sums of the window's steps that were checked already, or that a loaded state
        # carried in from before the resume.
        self._carried_loss_sum = torch.zeros((), dtype=torch.float64)
        self._carried_grad_norm_sum = torch.zeros((), dtype=torch.float32)
        self._carried_counts = _WindowCounts()
        # The window's steps since the last check, as they came. A step only appends its
        # output; a check (at a publish or a checkpoint) folds them into the carried sums, so
        # the list holds no step past the next checkpoint, even in a run that never publishes.
        self._steps: list[StepOutput] = []
        self._data_wait_time = 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        self._start = time.perf_counter()

    @property
    def num_steps(self) -> int:
        """The steps in the window, not published yet."""
        return self._carried_counts.num_steps + len(self._steps)

    def add_step(self, output: StepOutput) -> None:
        self._steps.append(output)

    def add_data_wait(self, seconds: float) -> None:
        self._data_wait_time += seconds

    def check_finite(self) -> None:
        """Stop every rank if a loss or gradient of the window was not finite (every rank of the
        root gang must call it)."""
        steps = self._steps
        # A skipped step's non-finite values were dealt with when it was skipped.
        losses = [
            (output.step_nr, loss) for output in steps if output.applied for loss in output.losses
        ]
        # The flag is one tensor for the run, and stays set once a gradient was not finite; only
        # steps since the last check can have set it unseen.
        if steps:
            self._gradient_flag = steps[-1].non_finite_gradients
        self._guard.raise_if_non_finite(
            losses=losses,
            gradient_flag=self._gradient_flag,
            unchecked_steps=(steps[0].step_nr, steps[-1].step_nr) if steps else None,
            num_targets={output.step_nr: output.num_targets for output in steps},
        )
        # The same additions in the same order as summing the whole window at its end, so a
        # fold changes no bit of what is published.
        self._carried_loss_sum, self._carried_grad_norm_sum = self._sums()
        self._carried_counts = self._counts()
        self._steps = []

    def compute(self, extra_values: Mapping[str, Any]) -> dict[str, Any]:
        """The window's values, then ``extra_values``, then the unit's metrics over the DP gang;
        the window starts anew after. Every rank must call it.
        """
        self.check_finite()
        loss_sum, grad_norm_sum = self._sums()
        counts = self._counts()
        sums = torch.stack(
            [
                loss_sum.to(self._device),
                torch.tensor(
                    float(counts.num_local_targets), device=self._device, dtype=torch.float64
                ),
            ]
        )
        # Over DP x SP: under sequence parallelism each rank holds a part of the targets.
        self._gangs.dp_sp.all_reduce(sums, ReduceOperation.SUM)
        loss_total, num_targets = sums.tolist()
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        steps = max(counts.num_steps, 1)
        per_device = counts.num_targets / elapsed / self._gangs.root.size
        values: dict[str, Any] = {"loss": loss_total / num_targets if num_targets else math.nan}
        if counts.num_grad_norms > 0:  # a window that ends at an unscheduled step may have none
            values["grad_norm"] = grad_norm_sum.item() / counts.num_grad_norms
        values |= {
            "num_targets": counts.num_targets,
            "targets_per_second": counts.num_targets / elapsed,
            "targets_per_second_per_device": per_device,
            "batch_size": counts.num_examples / steps,
            "data_wait_time": self._data_wait_time,
            "num_steps": counts.num_steps,
            "peak_memory_bytes": self._peak_memory_bytes(),
        }
        if self._guard.skips:
            values["num_skipped_steps"] = counts.num_skipped_steps
        mfu = self._throughput.mfu(per_device)
        if mfu is not None:
            values["mfu"] = mfu
        values.update(extra_values)
        values.update(
            self._unit_metrics.sync_and_compute(self._gangs.dp_sp, pp_gang=self._gangs.pp)
        )
        self._unit_metrics.reset_non_persistent_metrics()
        self.reset()
        return values

    def _sums(self) -> tuple[Tensor, Tensor]:
        # Step by step, as the steps came: the sums do not depend on where a resume split them.
        loss_sum = self._carried_loss_sum.to(self._device)
        grad_norm_sum = self._carried_grad_norm_sum.to(self._device)
        for output in self._steps:
            for loss in output.losses:
                loss_sum = loss_sum + loss
            if output.grad_norm is not None:
                norm = output.grad_norm.detach().to(self._device, torch.float32)
                grad_norm_sum = grad_norm_sum + norm
        return loss_sum, grad_norm_sum

    def _counts(self) -> _WindowCounts:
        carried = self._carried_counts
        local_targets, targets, examples = (
            carried.num_local_targets,
            carried.num_targets,
            carried.num_examples,
        )
        skipped, grad_norms = carried.num_skipped_steps, carried.num_grad_norms
        for output in self._steps:
            local_targets += output.num_targets
            targets += output.total_targets
            examples += output.total_examples
            skipped += not output.applied
            grad_norms += output.grad_norm is not None
        return _WindowCounts(
            num_local_targets=local_targets,
            num_targets=targets,
            num_examples=examples,
            num_steps=carried.num_steps + len(self._steps),
            num_skipped_steps=skipped,
            num_grad_norms=grad_norms,
        )

    def _peak_memory_bytes(self) -> int:
        """The most any rank used since the last publish (CUDA) or since it started (CPU)."""
        if self._device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        else:
            # Linux reports the peak resident set in KiB; it cannot be reset.
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak_tensor = torch.tensor([peak], dtype=torch.int64)
        self._gangs.root.all_reduce(peak_tensor, ReduceOperation.MAX)
        return int(peak_tensor.item())

    def state_dict(self) -> dict[str, Any]:
        loss_sum, grad_norm_sum = self._sums()
        counts = self._counts()
        return {
            "window": {
                "loss_sum": loss_sum.cpu(),
                "grad_norm_sum": grad_norm_sum.cpu(),
                "num_grad_norms": counts.num_grad_norms,
                "num_local_targets": counts.num_local_targets,
                "num_targets": counts.num_targets,
                "num_examples": counts.num_examples,
                "num_steps": counts.num_steps,
                "num_skipped_steps": counts.num_skipped_steps,
            },
            "unit_metrics": self._unit_metrics.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(state, {"window", "unit_metrics"}, what="train_metrics")
        window = state["window"]
        check_state_keys(window, _WINDOW_KEYS, what="train_metrics window")
        self.reset()
        self._carried_loss_sum = window["loss_sum"].to(torch.float64)
        self._carried_grad_norm_sum = window["grad_norm_sum"].to(torch.float32)
        self._carried_counts = _WindowCounts(
            num_local_targets=int(window["num_local_targets"]),
            num_targets=float(window["num_targets"]),
            num_examples=float(window["num_examples"]),
            num_steps=int(window["num_steps"]),
            num_skipped_steps=int(window["num_skipped_steps"]),
            num_grad_norms=int(window["num_grad_norms"]),
        )
        self._unit_metrics.load_state_dict(state["unit_metrics"])


def describe_devices(gangs: Gangs) -> str:
    """The device, the world layout and the memory used so far, for the log at start."""
    device = gangs.root.device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.memory_allocated(device)
    else:
        name = f"CPU ({torch.get_num_threads()} threads)"
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sp = f" x sp_size {gangs.sp.size}" if gangs.sp.size > 1 else ""
    return (
        f"{name}, {gangs.root.size} processes (dp_size {gangs.dp.size}{sp} x tp_size "
        f"{gangs.tp.size}), {memory / 2**20:.0f} MiB of memory in use on rank {gangs.root.rank}"
    )
