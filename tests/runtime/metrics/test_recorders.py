"""Metric recorders: what lands on disk is read back and checked."""

from __future__ import annotations

import csv
import logging
import math
import re
from pathlib import Path

import pytest

from runtime import (
    CompositeMetricRecorder,
    CsvMetricRecorder,
    JsonlMetricRecorder,
    LogMetricRecorder,
    TensorBoardRecorder,
    WandbRecorder,
)
from tests.conftest import read_jsonl, read_scalars


def test_jsonl_writes_one_object_per_publish_and_a_file_per_run(tmp_path: Path) -> None:
    recorder = JsonlMetricRecorder(tmp_path)
    recorder.record("train", 10, {"loss": 2.5, "lr": 0.1})
    recorder.record("valid/wiki", 10, {"nll_loss": 3.0})
    recorder.record("train", 20, {"loss": 2.0, "lr": 0.05})
    recorder.close()

    assert read_jsonl(tmp_path / "train.jsonl") == [
        {"step_nr": 10, "loss": 2.5, "lr": 0.1},
        {"step_nr": 20, "loss": 2.0, "lr": 0.05},
    ]
    assert read_jsonl(tmp_path / "valid" / "wiki.jsonl") == [{"step_nr": 10, "nll_loss": 3.0}]


def test_jsonl_appends_after_a_restart_and_stays_strict_json(tmp_path: Path) -> None:
    first = JsonlMetricRecorder(tmp_path)
    first.record("train", 1, {"loss": 1.0})
    first.close()
    second = JsonlMetricRecorder(tmp_path)
    second.record("train", 2, {"loss": math.nan, "grad_norm": math.inf})
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
    recorder.record("train", 3, {"loss": 1.5})
    assert read_jsonl(tmp_path / "train.jsonl") == [{"step_nr": 3, "loss": 1.5}]
    recorder.close()


def read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as file:
        return list(csv.reader(file))


def test_csv_writes_a_header_and_one_row_per_publish_in_a_file_per_run(tmp_path: Path) -> None:
    recorder = CsvMetricRecorder(tmp_path)
    recorder.record("train", 10, {"lr": 0.1, "loss": 2.5})
    recorder.record("valid/wiki", 10, {"nll_loss": 3.0})
    # Before close: a killed run leaves every row it published.
    assert read_csv(tmp_path / "train.csv") == [["step_nr", "loss", "lr"], ["10", "2.5", "0.1"]]
    recorder.record("train", 20, {"loss": 2.0, "lr": 0.05})
    recorder.close()

    assert read_csv(tmp_path / "train.csv") == [
        ["step_nr", "loss", "lr"],
        ["10", "2.5", "0.1"],
        ["20", "2.0", "0.05"],
    ]
    assert read_csv(tmp_path / "valid" / "wiki.csv") == [["step_nr", "nll_loss"], ["10", "3.0"]]


def test_csv_adds_a_new_metric_as_a_column_and_leaves_missing_cells_empty(
    tmp_path: Path,
) -> None:
    recorder = CsvMetricRecorder(tmp_path)
    recorder.record("train", 1, {"loss": 1.0})
    recorder.record("train", 2, {"loss": 0.5, "loss_scale": 64.0, "note": "a, b"})
    recorder.record("train", 3, {"note": "c"})
    recorder.close()

    assert read_csv(tmp_path / "train.csv") == [
        ["step_nr", "loss", "loss_scale", "note"],
        ["1", "1.0", "", ""],
        ["2", "0.5", "64.0", "a, b"],
        ["3", "", "", "c"],
    ]
    assert not list(tmp_path.glob(".*partial"))


def test_csv_appends_after_a_restart_under_the_header_it_finds(tmp_path: Path) -> None:
    first = CsvMetricRecorder(tmp_path)
    first.record("train", 1, {"loss": 1.0, "lr": 0.1})
    first.close()
    second = CsvMetricRecorder(tmp_path)
    second.record("train", 2, {"lr": 0.1, "loss": math.nan, "grad_norm": math.inf})
    second.close()

    rows = read_csv(tmp_path / "train.csv")
    assert rows == [
        ["step_nr", "loss", "lr", "grad_norm"],
        ["1", "1.0", "0.1", ""],
        ["2", "nan", "0.1", "inf"],
    ]
    assert math.isnan(float(rows[2][1])) and float(rows[2][3]) == math.inf


def test_tensorboard_scalars_read_back_per_run(tmp_path: Path) -> None:
    recorder = TensorBoardRecorder(tmp_path)
    recorder.record("train", 10, {"loss": 2.5, "note": "text is skipped"})
    recorder.record("train", 20, {"loss": 2.0})
    recorder.record("valid", 20, {"nll_loss": 3.25})
    recorder.close()

    assert read_scalars(tmp_path / "train") == {"loss": [(10, 2.5), (20, 2.0)]}
    assert read_scalars(tmp_path / "valid") == {"nll_loss": [(20, 3.25)]}


def test_log_recorder_writes_one_line_per_publish(caplog: pytest.LogCaptureFixture) -> None:
    recorder = LogMetricRecorder(logging.getLogger("trainkit.test"))
    with caplog.at_level(logging.INFO, logger="trainkit.test"):
        recorder.record("train", 7, {"lr": 0.001, "loss": 2.345678})
    assert caplog.messages == ["train step 7: loss 2.346 | lr 0.001"]


def test_composite_hands_values_to_every_recorder(tmp_path: Path) -> None:
    recorder = CompositeMetricRecorder(
        [JsonlMetricRecorder(tmp_path / "a"), JsonlMetricRecorder(tmp_path / "b")]
    )
    recorder.record("train", 1, {"loss": 1.0})
    recorder.close()
    for name in ("a", "b"):
        assert read_jsonl(tmp_path / name / "train.jsonl") == [{"step_nr": 1, "loss": 1.0}]


def test_wandb_offline_run_is_created_and_resumed_under_the_same_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    first = WandbRecorder(project="trainkit-test", output_dir=tmp_path, config={"lr": 0.1})
    first.record("train", 1, {"loss": 2.0, "note": "skipped"})
    first.close()
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert run_id == first.run_id

    second = WandbRecorder(project="trainkit-test", output_dir=tmp_path)
    second.record("train", 2, {"loss": 1.0})
    second.close()
    assert second.run_id == run_id

    # Each offline launch leaves a run directory holding its run file, named by the one id
    # (W&B adds -1 to the second directory when both launches fall within the same second).
    run_dirs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", run_dir.name)
        assert (run_dir / f"run-{run_id}.wandb").is_file()
