"""Training on windows of data: each window a data epoch with its hooks, checkpoints every N
windows, the end of the stream, a stop while waiting, exact resume; and, under torchrun, ranks
that read disjoint shards and agree on every window."""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from gangs import Gangs
from runtime import PREEMPTED_EXIT_CODE, TrainerCallback, TrainerError
from runtime.data.windows import mark_stopped
from tests.conftest import assert_ok, torchrun
from tests.workers.train_windows import train, write_window

WORKER = "tests/workers/train_windows.py"


def make_windows(
    root: Path, sizes: Sequence[int], *, first: int = 0, first_id: int = 0
) -> dict[str, list[int]]:
    """Ready windows ``w<first>``, ``w<first + 1>``... of consecutive example ids from
    ``first_id``; returns their ids by name."""
    windows: dict[str, list[int]] = {}
    start = first_id
    for size in sizes:
        name = f"w{first + len(windows)}"
        windows[name] = list(range(start, start + size))
        write_window(root, name, windows[name])
        start += size
    return windows


def report(out: Path, rank: int = 0) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / f"report_rank_{rank}.json").read_text())
    return loaded


def checkpoint_steps(out: Path) -> list[str]:
    names = [p.name for p in (out / "checkpoints").glob("step_*")]
    return sorted(names, key=lambda name: int(name.removeprefix("step_")))


def params(out: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(out / "params.pt", weights_only=True)
    return loaded


def assert_same_params(a: Path, b: Path) -> None:
    first, second = params(a), params(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_each_window_is_a_data_epoch_and_the_stop_marker_ends_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, out = tmp_path / "windows", tmp_path / "out"
    windows = make_windows(root, [8, 8, 8])
    mark_stopped(root)
    # One rank, batches of 4: two steps a window.
    options = {"root": str(root), "batch_size": 4, "checkpoint_every_windows": 2}
    train(out, Gangs.single(), options)

    first = report(out)
    assert (first["exit_code"], first["stop_reason"]) == (0, "end_of_data")
    assert first["events"] == [
        ["epoch_begin", 1, 0],
        ["out_of_data", 1, 2],
        ["epoch_end", 1, 2],
        ["epoch_begin", 2, 2],
        ["out_of_data", 2, 4],
        ["checkpoint", 4],
        ["epoch_end", 2, 4],
        ["epoch_begin", 3, 4],
        ["out_of_data", 3, 6],
        ["epoch_end", 3, 6],
        ["checkpoint", 6],
        ["train_end", 6],
    ]
    assert [step["window"] for step in first["steps"]] == ["w0", "w0", "w1", "w1", "w2", "w2"]
    for name, ids in windows.items():
        read = [i for step in first["steps"] if step["window"] == name for i in step["ids"]]
        assert sorted(read) == ids
    assert checkpoint_steps(out) == ["step_4", "step_6"]

    with caplog.at_level(logging.INFO):
        train(out, Gangs.single(), options)
    assert "The run finished at step 6 already; nothing to do." in caplog.messages
    assert report(out)["events"] == []

    # A window that arrived after the end: the relaunch reads it.
    make_windows(root, [8], first=3, first_id=100)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(out, Gangs.single(), options)
    assert any("the data reader has more now: training on" in m for m in caplog.messages)
    again = report(out)
    assert again["stop_reason"] == "end_of_data"
    assert [s["window"] for s in again["steps"]] == ["w3", "w3"]
    # The relaunch goes on from the end of w2: that epoch ends again, then w3 begins.
    assert again["events"] == [
        ["out_of_data", 3, 6],
        ["epoch_end", 3, 6],
        ["epoch_begin", 4, 6],
        ["out_of_data", 4, 8],
        ["epoch_end", 4, 8],
        ["checkpoint", 8],
        ["train_end", 8],
    ]


def test_max_num_windows_ends_the_run_and_a_larger_one_trains_on(tmp_path: Path) -> None:
    root = tmp_path / "windows"
    make_windows(root, [4, 4, 4])
    options = {"root": str(root), "batch_size": 4, "max_num_windows": 2}
    train(tmp_path / "out", Gangs.single(), options)
    first = report(tmp_path / "out")
    assert (first["stop_reason"], len(first["steps"])) == ("end_of_data", 2)
    assert checkpoint_steps(tmp_path / "out") == ["step_2"]

    train(tmp_path / "out", Gangs.single(), {**options, "max_num_windows": 3})
    assert [s["window"] for s in report(tmp_path / "out")["steps"]] == ["w2"]


class SignalAfterEpoch(TrainerCallback):
    """Sends this process SIGTERM at the end of a data epoch, before the wait for the next."""

    def on_epoch_end(self, *, epoch_nr: int, step_nr: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_signal_ends_the_wait_and_the_relaunch_reads_the_next_window(
    tmp_path: Path,
) -> None:
    root, out = tmp_path / "windows", tmp_path / "out"
    make_windows(root, [8])
    options = {"root": str(root), "batch_size": 4, "wait_timeout": 30.0}
    train(out, Gangs.single(), options, callbacks=[SignalAfterEpoch()])
    stopped = report(out)
    assert (stopped["exit_code"], stopped["stop_reason"]) == (PREEMPTED_EXIT_CODE, "preempted")
    assert checkpoint_steps(out) == ["step_2"]

    write_window(root, "w1", list(range(8, 16)))
    mark_stopped(root)
    train(out, Gangs.single(), options)
    resumed = report(out)
    assert (resumed["exit_code"], resumed["stop_reason"]) == (0, "end_of_data")
    assert [s["window"] for s in resumed["steps"]] == ["w1", "w1"]
    train(tmp_path / "reference", Gangs.single(), options)
    assert_same_params(out, tmp_path / "reference")


class SignalAtStart(TrainerCallback):
    def on_train_begin(self, *, step_nr: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_signal_while_waiting_for_the_first_window_stops_before_any_step(
    tmp_path: Path,
) -> None:
    root, out = tmp_path / "windows", tmp_path / "out"
    root.mkdir()
    options = {"root": str(root), "wait_timeout": 30.0}
    train(out, Gangs.single(), options, callbacks=[SignalAtStart()])
    stopped = report(out)
    assert (stopped["exit_code"], stopped["events"], stopped["steps"]) == (
        PREEMPTED_EXIT_CODE,
        [],
        [],
    )
    assert checkpoint_steps(out) == []


def test_a_stream_that_ends_before_its_first_window_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "windows"
    root.mkdir()
    mark_stopped(root)
    with pytest.raises(TrainerError, match="The data reader has no data to train on"):
        train(tmp_path / "out", Gangs.single(), {"root": str(root)})


def test_a_resume_mid_window_ends_with_the_weights_of_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    root = tmp_path / "windows"
    make_windows(root, [12, 12, 12])
    mark_stopped(root)
    options: dict[str, Any] = {"root": str(root), "batch_size": 4}
    # Three steps a window: step 4 is the first of the second window.
    train(tmp_path / "reference", Gangs.single(), options)
    train(tmp_path / "out", Gangs.single(), {**options, "max_num_steps": 4})
    assert report(tmp_path / "out")["stop_reason"] == "max_num_steps"
    train(tmp_path / "out", Gangs.single(), options)
    assert [s["step"] for s in report(tmp_path / "out")["steps"]] == list(range(5, 10))
    assert_same_params(tmp_path / "out", tmp_path / "reference")


# ------------------------------------------------------------------ torchrun, 2 processes


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[int]]]:
    """Two launches of 2 ranks: a reference run and a run stopped mid-window at step 7, then
    the resume of the latter. Windows of 12 examples: 3 steps of 2 x 2 examples each."""
    base = tmp_path_factory.mktemp("windows")
    root = base / "windows"
    windows = make_windows(root, [12, 12, 12, 12])
    (root / "w2" / "_SUCCESS").unlink()
    options = {
        "root": str(root),
        "checkpoint_every_windows": 2,
        "late_window": "w2",
        "late_after_epoch": 2,
        "max_num_steps": 7,
        "reference": True,
    }
    assert_ok(torchrun(2, WORKER, str(base), json.dumps(options), timeout=240))
    stopped = [report(base / "run", rank) for rank in range(2)]
    assert [r["stop_reason"] for r in stopped] == ["max_num_steps"] * 2
    del options["reference"], options["max_num_steps"]
    assert_ok(torchrun(2, WORKER, str(base), json.dumps(options), timeout=240))
    return base, windows


@pytest.mark.distributed
def test_ranks_read_disjoint_shards_and_agree_on_every_window_and_checkpoint(
    launches: tuple[Path, dict[str, list[int]]],
) -> None:
    base, windows = launches
    reference = [report(base / "reference", rank) for rank in range(2)]
    for r in reference:
        assert (r["exit_code"], r["stop_reason"]) == (0, "end_of_data")
    # The window marked ready while the ranks checked is read by both, at the same step.
    assert [s["window"] for s in reference[0]["steps"]] == [
        name for name in windows for _ in range(3)
    ]
    assert reference[0]["events"] == reference[1]["events"]
    assert [e[1:] for e in reference[0]["events"] if e[0] == "epoch_begin"] == [
        [1, 0],
        [2, 3],
        [3, 6],
        [4, 9],
    ]
    for step0, step1 in zip(reference[0]["steps"], reference[1]["steps"], strict=True):
        assert (step0["step"], step0["window"]) == (step1["step"], step1["window"])
        assert not set(step0["ids"]) & set(step1["ids"])
    for name, ids in windows.items():
        read = [i for r in reference for s in r["steps"] if s["window"] == name for i in s["ids"]]
        assert sorted(read) == ids
    assert checkpoint_steps(base / "reference") == ["step_6", "step_12"]


@pytest.mark.distributed
def test_a_resume_in_a_new_launch_continues_exactly_mid_window(
    launches: tuple[Path, dict[str, list[int]]],
) -> None:
    base, _ = launches
    for rank in range(2):
        resumed = report(base / "run", rank)
        assert resumed["stop_reason"] == "end_of_data"
        assert resumed["steps"] == report(base / "reference", rank)["steps"][7:]
    assert checkpoint_steps(base / "run") == ["step_6", "step_7", "step_12"]
    assert_same_params(base / "run", base / "reference")
