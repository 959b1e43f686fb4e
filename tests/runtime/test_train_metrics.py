"""Memory and throughput in the train metrics, and Python's garbage collection on a schedule."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest

from runtime import TrainerCallback
from tests.conftest import make_toy_trainer, read_jsonl


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
    with caplog.at_level(logging.INFO, logger="runtime.trainer"):
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


class GcProbe(TrainerCallback):
    def __init__(self) -> None:
        self.enabled_at_steps: list[bool] = []
        self.full_collections_at_steps: list[int] = []
        self._step_nr = 0

    def on_step_end(self, *, step_nr: int) -> None:
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
    # Collected after steps 3 and 6 (the callback runs after the collection of its step).
    assert [s for s in probe.full_collections_at_steps if s < 6][:2] == [2, 5]
