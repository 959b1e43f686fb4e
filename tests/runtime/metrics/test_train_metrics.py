"""The train metrics' window, memory and throughput, and Python's garbage collection on a
schedule."""

from __future__ import annotations

import gc
import logging
import math
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gangs import Gangs
from runtime import NonFiniteError, TrainerCallback
from runtime.metrics.device_peaks import compute_dtype, peak_flops
from runtime.metrics.train_metrics import StepOutput, Throughput, TrainMetrics
from runtime.parallel import wrapping
from runtime.training.non_finite import NonFiniteGuard
from tests.conftest import make_toy_trainer, read_jsonl
from units import MetricBag


def make_metrics() -> TrainMetrics:
    gangs = Gangs.single()
    guard = NonFiniteGuard(
        policy="error",
        max_consecutive_skipped_steps=10,
        root_gang=gangs.root,
        checks_gradients=True,
    )
    return TrainMetrics(unit_metrics=MetricBag(), gangs=gangs, guard=guard)


def step_output(step_nr: int, *, loss: float | None = None) -> StepOutput:
    """A step of 3 targets in 2 examples, with an awkward loss and a gradient norm."""
    return StepOutput(
        step_nr=step_nr,
        losses=[torch.tensor(loss if loss is not None else 0.1 * step_nr + 1 / 3)],
        num_targets=3,
        total_targets=3.0,
        total_examples=2.0,
        grad_norm=torch.tensor(1.0 / step_nr),
        non_finite_gradients=torch.zeros(()),
        stop_requested=False,
    )


def window_of(metrics: TrainMetrics) -> dict[str, Any]:
    window: dict[str, Any] = metrics.state_dict()["window"]
    return window


def test_a_check_in_mid_window_changes_no_bit_of_the_window() -> None:
    checked, unchecked = make_metrics(), make_metrics()
    for step_nr in range(1, 8):
        for metrics in (checked, unchecked):
            metrics.add_step(step_output(step_nr))
        if step_nr in (3, 5):
            checked.check_finite()  # as a checkpoint does

    checked_window, unchecked_window = window_of(checked), window_of(unchecked)
    for key in ("loss_sum", "grad_norm_sum"):
        assert torch.equal(checked_window.pop(key), unchecked_window.pop(key))
    assert checked_window == unchecked_window
    assert checked_window["num_steps"] == 7 and checked_window["num_local_targets"] == 21
    published = checked.compute({}), unchecked.compute({})
    for key in ("loss", "grad_norm", "num_targets", "batch_size", "num_steps"):
        assert published[0][key] == published[1][key]
    assert published[0]["batch_size"] == 2.0


def test_a_checked_window_holds_no_step() -> None:
    metrics = make_metrics()
    output = step_output(1)
    loss = weakref.ref(output.losses[0])
    metrics.add_step(output)
    del output
    assert loss() is not None
    # A run that never publishes still checks at each checkpoint: its window must not grow.
    metrics.check_finite()
    assert loss() is None
    assert window_of(metrics)["num_steps"] == 1


def test_a_non_finite_loss_after_a_check_is_found_at_its_step() -> None:
    metrics = make_metrics()
    metrics.add_step(step_output(1))
    metrics.check_finite()
    metrics.add_step(step_output(2, loss=math.nan))
    with pytest.raises(NonFiniteError, match="The loss was not finite at step 2 on rank 0"):
        metrics.check_finite()


def test_memory_and_throughput_are_published(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_toy_trainer(
        tmp_path,
        max_num_steps=4,
        publish_metrics_every_n_steps=2,
        metrics_dir=tmp_path / "metrics",
        flops_per_target=1e6,
        device_peak_flops=1e12,
    )
    with caplog.at_level(logging.INFO, logger="runtime"):
        assert trainer.run() == 0
    records = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert [r["step_nr"] for r in records] == [2, 4]
    for record in records:
        # A Python process with torch loaded holds more than 50 MiB, and this machine has 24 GiB.
        assert 50 * 2**20 < record["peak_memory_bytes"] < 24 * 2**30
        # One process: every target was processed by this one device.
        assert record["targets_per_second_per_device"] == pytest.approx(
            record["targets_per_second"]
        )
        assert record["mfu"] == pytest.approx(record["targets_per_second_per_device"] * 1e6 / 1e12)
        assert "num_skipped_steps" not in record  # only with nan_policy="skip"
    assert "Training from step 0 on CPU" in caplog.text
    assert "1 processes (dp_size 1 x tp_size 1)" in caplog.text


@pytest.mark.parametrize(
    ("device_name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", 181e12),  # not an L4
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_the_peak_of_common_cuda_devices_is_known(device_name: str, peak: float | None) -> None:
    assert peak_flops(device_name, "bf16") == peak


def test_mfu_on_a_known_cuda_device_needs_no_arguments() -> None:
    # 6 FLOPs per parameter and target, over the device's dense bf16 peak.
    throughput = Throughput.for_device(
        None, None, device_name="NVIDIA H100 80GB HBM3", num_parameters=1_000_000
    )
    assert throughput.mfu(1e5) == pytest.approx(1e5 * 6e6 / 989e12)
    # A unit's own FLOPs count and a given peak win over the defaults.
    given = Throughput.for_device(
        8e6, 500e12, device_name="NVIDIA H100 80GB HBM3", num_parameters=1_000_000
    )
    assert given.mfu(1e5) == pytest.approx(1e5 * 8e6 / 500e12)


@pytest.mark.parametrize(
    ("dtype", "matmul_precision", "peak"),
    [
        (torch.bfloat16, "highest", 989e12),
        (torch.float16, "highest", 989e12),
        (torch.float32, "high", 495e12),  # TF32 allowed
        (torch.float32, "highest", 67e12),  # torch's default: no TF32
    ],
)
def test_mfu_divides_by_the_peak_of_the_precision_that_runs(
    dtype: torch.dtype, matmul_precision: str, peak: float
) -> None:
    """A float32 run over the bf16 peak would report a fifteenth of its utilization."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        throughput = Throughput.for_device(
            None,
            None,
            device_name="NVIDIA H100 80GB HBM3",
            num_parameters=1_000_000,
            compute_dtype=dtype,
        )
    finally:
        torch.set_float32_matmul_precision(previous)
    assert throughput.device_peak_flops == peak


def test_the_compute_dtype_is_autocasts_then_fsdp2s_then_the_parameters() -> None:
    model = nn.Linear(2, 2)
    assert compute_dtype(model, autocast_dtype=None) == torch.float32
    assert compute_dtype(model, autocast_dtype=torch.bfloat16) == torch.bfloat16
    assert compute_dtype(model.to(torch.bfloat16), autocast_dtype=None) == torch.bfloat16
    # FSDP2's param_dtype, as apply_data_parallel gave it (its policy has no public getter).
    # (A weak key: it goes with the module.)
    sharded = nn.Linear(2, 2)
    wrapping._FSDP_PARAM_DTYPES[sharded] = torch.bfloat16
    assert compute_dtype(sharded, autocast_dtype=None) == torch.bfloat16
    assert compute_dtype(sharded, autocast_dtype=torch.float16) == torch.float16


def test_mfu_on_an_unknown_device_is_not_published_unless_its_peak_is_given(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        unknown = Throughput.for_device(
            8e6, None, device_name="Tesla V100-SXM2-32GB", num_parameters=10
        )
    assert unknown.mfu(1e5) is None
    assert "the bf16 peak FLOP/s of a Tesla V100-SXM2-32GB is not known" in caplog.text
    # On a CPU nothing is guessed: no arguments, no mfu.
    assert Throughput.for_device(None, None, device_name=None, num_parameters=10).mfu(1.0) is None


class GcProbe(TrainerCallback):
    def __init__(self) -> None:
        self.enabled_at_steps: list[bool] = []
        self.full_collections_at_steps: list[int] = []
        self._step_nr = 0

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        self._step_nr = step_nr
        self.enabled_at_steps.append(gc.isenabled())

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            self.full_collections_at_steps.append(self._step_nr)


def test_gc_runs_on_schedule_only_during_training(tmp_path: Path) -> None:
    probe = GcProbe()
    trainer = make_toy_trainer(tmp_path, max_num_steps=6, gc_every_n_steps=3, callbacks=[probe])
    assert gc.isenabled()
    gc.callbacks.append(probe.on_gc)
    try:
        assert trainer.run() == 0
    finally:
        gc.callbacks.remove(probe.on_gc)
    assert probe.enabled_at_steps == [False] * 6
    assert gc.isenabled()
    # Collected after steps 3 and 6, after the step's callbacks.
    assert probe.full_collections_at_steps[:2] == [3, 6]
