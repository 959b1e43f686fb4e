"""No host-device synchronization in a steady step: a step that does not publish, validate or
checkpoint never makes the host wait for the device (``pytest -k host_sync``); the torchrun
layouts are in ``test_host_sync_distributed.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gangs import Gangs
from runtime import TorchProfiler
from tests.conftest import make_toy_trainer
from tests.sync_detector import FEATURES, SYNCS_PER_STEP, WATCHED_STEPS, SyncWindow


def watched_syncs(tmp_path: Path, feature: str) -> list[str]:
    options = dict(FEATURES[feature])
    if options.pop("profiler", False):
        options["profiler"] = TorchProfiler(1, 2, tmp_path / "profile", Gangs.single().root)
    window = SyncWindow()
    trainer = make_toy_trainer(
        tmp_path,
        max_num_steps=10,
        publish_metrics_every_n_steps=100,
        callbacks=[window],
        dataset_size=256,
        **options,
    )
    trainer.run()
    trainer.close()
    return window.detector.syncs


@pytest.mark.parametrize("feature", [f for f in FEATURES if f not in SYNCS_PER_STEP])
def test_a_steady_step_host_sync_free(tmp_path: Path, feature: str) -> None:
    assert watched_syncs(tmp_path, feature) == []


@pytest.mark.parametrize("feature", SYNCS_PER_STEP)
def test_deciding_on_the_host_host_syncs_as_pinned(tmp_path: Path, feature: str) -> None:
    syncs = watched_syncs(tmp_path, feature)
    assert len(syncs) == SYNCS_PER_STEP[feature] * WATCHED_STEPS, syncs


def test_the_pinned_host_syncs_are_the_decisions(tmp_path: Path) -> None:
    # Which reads they are, so that a new sync cannot stand in for a removed one unnoticed.
    skip = watched_syncs(tmp_path / "skip", "nan_policy_skip")
    assert all("step_totals.py" in s or "non_finite.py" in s for s in skip), skip
    fp16 = watched_syncs(tmp_path / "fp16", "fp16")
    assert all("loss_scale.py" in s for s in fp16), fp16
