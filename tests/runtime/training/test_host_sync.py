"""No host-device synchronization in a steady step: a step that does not publish, validate or
checkpoint never makes the host wait for the device (``pytest -k host_sync``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gangs import Gangs
from runtime import TorchProfiler, TrainerCallback
from tests.conftest import make_toy_trainer
from tests.sync_detector import HostSyncDetector

FIRST, LAST = 3, 7
"""The detector watches from the end of step FIRST to the end of step LAST: steps 4 to 7 and the
loop's work between them, with nothing due (metrics publish at step 100)."""


class SyncWindow(TrainerCallback):
    def __init__(self) -> None:
        self.detector = HostSyncDetector()

    def on_step_end(self, *, step_nr: int, **_: Any) -> None:
        if step_nr == FIRST:
            self.detector.enter()
        elif step_nr == LAST:
            self.detector.exit()


FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "accumulation": {"num_accumulate": 2},
    "clipping": {"max_gradient_norm": 0.5},
    "nan_policy_error": {"nan_policy": "error"},
}


def watched_syncs(tmp_path: Path, **options: Any) -> list[str]:
    window = SyncWindow()
    trainer = make_toy_trainer(
        tmp_path,
        max_num_steps=10,
        publish_metrics_every_n_steps=100,
        callbacks=[window],
        # No data epoch ends in the window: a reader checks once an epoch that the ranks agree.
        dataset_size=256,
        **options,
    )
    trainer.run()
    trainer.close()
    return window.detector.syncs


@pytest.mark.parametrize("feature", FEATURES)
def test_a_steady_step_host_sync_free(tmp_path: Path, feature: str) -> None:
    assert watched_syncs(tmp_path, **FEATURES[feature]) == []


def test_a_steady_step_with_the_profiler_host_sync_free(tmp_path: Path) -> None:
    profiler = TorchProfiler(1, 2, tmp_path / "profile", Gangs.single().root)
    assert watched_syncs(tmp_path, profiler=profiler) == []


# The features that decide on the host whether a step's update is applied read two values a
# step: whether every loss was finite, and the gradient norm.


def test_nan_policy_skip_host_syncs_twice_a_step_to_decide(tmp_path: Path) -> None:
    syncs = watched_syncs(tmp_path, nan_policy="skip")
    assert len(syncs) == 2 * (LAST - FIRST), syncs


def test_fp16_loss_scaling_host_syncs_once_a_step_to_decide(tmp_path: Path) -> None:
    syncs = watched_syncs(tmp_path, dtype=torch.float16, amp=True)
    assert len(syncs) == LAST - FIRST, syncs
