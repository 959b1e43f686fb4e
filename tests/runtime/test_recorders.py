"""Metric recorders: what lands on disk is read back and checked."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest

from runtime import (
    CompositeMetricRecorder,
    JsonlMetricRecorder,
    LogMetricRecorder,
    TensorBoardRecorder,
    WandbRecorder,
)
from tests.conftest import read_jsonl, read_scalars


def test_jsonl_writes_one_object_per_publish_and_a_file_per_run(tmp_path: Path) -> None:
    recorder = JsonlMetricRecorder(tmp_path)
    recorder.record_metrics("train", {"loss": 2.5, "lr": 0.1}, 10)
    recorder.record_metrics("valid/wiki", {"nll_loss": 3.0}, 10)
    recorder.record_metrics("train", {"loss": 2.0, "lr": 0.05}, 20)
    recorder.close()

    assert read_jsonl(tmp_path / "train.jsonl") == [
        {"step_nr": 10, "loss": 2.5, "lr": 0.1},
        {"step_nr": 20, "loss": 2.0, "lr": 0.05},
    ]
    assert read_jsonl(tmp_path / "valid" / "wiki.jsonl") == [{"step_nr": 10, "nll_loss": 3.0}]


def test_jsonl_appends_after_a_restart_and_stays_strict_json(tmp_path: Path) -> None:
    first = JsonlMetricRecorder(tmp_path)
    first.record_metrics("train", {"loss": 1.0}, 1)
    first.close()
    second = JsonlMetricRecorder(tmp_path)
    second.record_metrics("train", {"loss": math.nan, "grad_norm": math.inf}, 2)
    second.close()

    text = (tmp_path / "train.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_jsonl(tmp_path / "train.jsonl") == [
        {"step_nr": 1, "loss": 1.0},
        {"step_nr": 2, "loss": None, "grad_norm": None},
    ]


def test_jsonl_line_is_on_disk_before_close(tmp_path: Path) -> None:
    # A killed run must not lose what it already published.
    recorder = JsonlMetricRecorder(tmp_path)
    recorder.record_metrics("train", {"loss": 1.5}, 3)
    assert read_jsonl(tmp_path / "train.jsonl") == [{"step_nr": 3, "loss": 1.5}]
    recorder.close()


def test_tensorboard_scalars_read_back_per_run(tmp_path: Path) -> None:
    recorder = TensorBoardRecorder(tmp_path)
    recorder.record_metrics("train", {"loss": 2.5, "note": "text is skipped"}, 10)
    recorder.record_metrics("train", {"loss": 2.0}, 20)
    recorder.record_metrics("valid", {"nll_loss": 3.25}, 20)
    recorder.close()

    assert read_scalars(tmp_path / "train") == {"loss": [(10, 2.5), (20, 2.0)]}
    assert read_scalars(tmp_path / "valid") == {"nll_loss": [(20, 3.25)]}


def test_log_recorder_writes_one_line_per_publish(caplog: pytest.LogCaptureFixture) -> None:
    recorder = LogMetricRecorder(logging.getLogger("trainkit.test"))
    with caplog.at_level(logging.INFO, logger="trainkit.test"):
        recorder.record_metrics("train", {"lr": 0.001, "loss": 2.345678}, 7)
    assert caplog.messages == ["train step 7: loss 2.346 | lr 0.001"]


def test_composite_hands_values_to_every_recorder(tmp_path: Path) -> None:
    recorder = CompositeMetricRecorder(
        [JsonlMetricRecorder(tmp_path / "a"), JsonlMetricRecorder(tmp_path / "b")]
    )
    recorder.record_metrics("train", {"loss": 1.0}, 1)
    recorder.close()
    for name in ("a", "b"):
        assert read_jsonl(tmp_path / name / "train.jsonl") == [{"step_nr": 1, "loss": 1.0}]


def test_wandb_offline_run_is_created_and_resumed_under_the_same_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    first = WandbRecorder(project="trainkit-test", output_dir=tmp_path, config={"lr": 0.1})
    first.record_metrics("train", {"loss": 2.0, "note": "skipped"}, 1)
    first.close()
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert run_id == first.run_id

    second = WandbRecorder(project="trainkit-test", output_dir=tmp_path)
    second.record_metrics("train", {"loss": 1.0}, 2)
    second.close()
    assert second.run_id == run_id

    # Each offline launch leaves a run directory holding its run file, named by the one id
    # (W&B adds -1 to the second directory when both launches fall within the same second).
    run_dirs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", run_dir.name)
        assert (run_dir / f"run-{run_id}.wandb").is_file()
