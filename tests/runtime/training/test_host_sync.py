"""No host-device synchronization in a steady step: a step that does not publish, validate or
checkpoint never makes the host wait for the device (``pytest -k host_sync``); the torchrun
layouts are in ``test_host_sync_distributed.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gangs import Gangs
from runtime import TorchProfiler
from tests.conftest import make_toy_trainer
from tests.sync_detector import FEATURES, SyncWindow, assert_as_pinned


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


@pytest.mark.parametrize("feature", FEATURES)
def test_a_steady_step_host_syncs_only_where_pinned(tmp_path: Path, feature: str) -> None:
    assert_as_pinned(feature, watched_syncs(tmp_path, feature))
