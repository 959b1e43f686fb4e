"""WindowedDataReader in one process: window order, readiness, the end of the stream, waiting,
exact resume, and bad input. Its rank behaviour is tested under torchrun in
tests/runtime/training/test_windowed_training.py."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gangs import FakeGang
from runtime.data import (
    DataReader,
    DataReaderError,
    DeviceDataReader,
    WaitInterrupted,
    WindowedDataReader,
    load_window_files,
)
from runtime.data.windows import mark_ready, mark_stopped, window_names
from tests.conftest import round_trip

Steps = list[list[list[int]]]


def write_window(root: Path, name: str, examples: list[int], *, ready: bool = True) -> Path:
    window = root / name
    window.mkdir(parents=True)
    (window / "part-0.json").write_text(json.dumps(examples[: len(examples) // 2]))
    (window / "part-1.json").write_text(json.dumps(examples[len(examples) // 2 :]))
    if ready:
        mark_ready(window)
    return window


def load_json(path: Path) -> list[int]:
    examples: list[int] = json.loads(path.read_text())
    return examples


def as_list(examples: list[int]) -> list[int]:
    return list(examples)


def make_reader(root: Path, **kwargs: Any) -> WindowedDataReader[list[int]]:
    kwargs.setdefault("load_window", load_window_files(load_json))
    kwargs.setdefault("gang", FakeGang())
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("poll_interval", 0.01)
    kwargs.setdefault("wait_timeout", 10.0)
    return WindowedDataReader(root=root, collate=as_list, **kwargs)


def read_epoch(reader: DataReader[list[int]]) -> Steps:
    return [batches for batches in reader]


def read_stream(reader: WindowedDataReader[list[int]]) -> dict[str, Steps]:
    """Every window's steps until the stream ends, by window name."""
    windows: dict[str, Steps] = {}
    while reader.has_next_epoch():
        if reader.window is not None:
            reader.reset()
        steps = read_epoch(reader)
        assert reader.window is not None
        windows[reader.window] = steps
    return windows


def test_ready_windows_are_read_in_name_order_until_the_stop_marker(tmp_path: Path) -> None:
    write_window(tmp_path, "2026-01-02", [20, 21, 22, 23])
    write_window(tmp_path, "2026-01-01", [10, 11, 12, 13, 14])
    write_window(tmp_path, "2026-01-03", [30, 31], ready=False)
    write_window(tmp_path, "_temporary", [99, 98])
    mark_stopped(tmp_path)
    assert window_names(tmp_path) == ["2026-01-01", "2026-01-02", "2026-01-03"]

    reader = make_reader(tmp_path)
    assert read_stream(reader) == {
        "2026-01-01": [[[10, 11]], [[12, 13]]],
        "2026-01-02": [[[20, 21]], [[22, 23]]],
    }
    assert reader.window_nr == 2
    assert not reader.has_next_epoch(wait=False)
    with pytest.raises(DataReaderError, match=r"No window follows after '2026-01-02'.*_STOP"):
        reader.reset()


def test_a_window_not_ready_holds_back_the_ready_ones_after_it(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1])
    late = write_window(tmp_path, "w1", [10, 11], ready=False)
    write_window(tmp_path, "w2", [20, 21])
    reader = make_reader(tmp_path, wait_timeout=0.1)
    read_epoch(reader)
    with pytest.raises(DataReaderError, match=r"for window 'w1' to become ready in"):
        reader.has_next_epoch()
    mark_ready(late)
    mark_stopped(tmp_path)
    assert read_stream(reader) == {"w1": [[[10, 11]]], "w2": [[[20, 21]]]}


def test_max_num_windows_ends_the_stream(tmp_path: Path) -> None:
    for nr in range(3):
        write_window(tmp_path, f"w{nr}", [nr * 10 + i for i in range(4)])
    reader = make_reader(tmp_path, max_num_windows=2)
    assert list(read_stream(reader)) == ["w0", "w1"]
    assert not reader.has_next_epoch()


def test_each_window_is_shuffled_by_its_own_seed(tmp_path: Path) -> None:
    write_window(tmp_path, "a", list(range(8)))
    write_window(tmp_path, "b", list(range(8)))
    mark_stopped(tmp_path)
    windows = read_stream(make_reader(tmp_path, shuffle=True, seed=5, batch_size=8))
    orders = [steps[0][0] for steps in windows.values()]
    assert orders[0] != orders[1]
    assert orders == [
        torch.randperm(8, generator=torch.Generator().manual_seed(5 + nr)).tolist() for nr in (1, 2)
    ]


def test_a_window_marked_ready_while_the_reader_waits_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_window(tmp_path, "w0", [0, 1])
    reader = make_reader(tmp_path)
    assert read_epoch(reader) == [[[0, 1]]]
    late = write_window(tmp_path, "w1", [10, 11], ready=False)
    assert reader.has_next_epoch(wait=False)  # not known yet: it cannot rule more data out

    writer = threading.Timer(0.3, mark_ready, args=(late,))
    writer.start()
    with caplog.at_level(logging.INFO, logger="runtime.data.windows"):
        started = time.monotonic()
        assert reader.has_next_epoch()
    writer.join()
    assert time.monotonic() - started >= 0.25
    assert "Waiting for window 'w1' to become ready" in caplog.text
    reader.reset()
    assert (reader.window, read_epoch(reader)) == ("w1", [[[10, 11]]])


def test_waiting_past_wait_timeout_is_a_clear_error(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1])
    reader = make_reader(tmp_path, wait_timeout=0.1)
    read_epoch(reader)
    with pytest.raises(DataReaderError, match=r"wait_timeout \(0.1 s\) for a window after 'w0'"):
        reader.has_next_epoch()


def test_a_stop_request_ends_the_wait(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1])
    reader = make_reader(tmp_path, wait_timeout=None)
    read_epoch(reader)
    requested = threading.Event()
    threading.Timer(0.2, requested.set).start()
    with pytest.raises(WaitInterrupted):
        reader.has_next_epoch(stop_requested=requested.is_set)
    # The wait was only cut short: a window that comes later is still read.
    write_window(tmp_path, "w1", [10, 11])
    assert reader.has_next_epoch(stop_requested=requested.is_set)


def test_the_first_window_is_waited_for_too(tmp_path: Path) -> None:
    reader = make_reader(tmp_path)
    threading.Timer(0.2, write_window, args=(tmp_path, "w0", [0, 1])).start()
    assert read_epoch(reader) == [[[0, 1]]]


@pytest.mark.parametrize("num_prefetch", [0, 2])
def test_a_resume_mid_window_continues_the_identical_stream(
    tmp_path: Path, num_prefetch: int
) -> None:
    for nr in range(3):
        write_window(tmp_path, f"w{nr}", [nr * 100 + i for i in range(13)])
    mark_stopped(tmp_path)
    options = {"shuffle": True, "seed": 3, "num_accumulate": 2, "num_prefetch": num_prefetch}
    expected = read_stream(make_reader(tmp_path, **options))

    first = make_reader(tmp_path, **options)
    read_epoch(first)
    first.reset()
    taken = [next(first)]
    state = round_trip(first.state_dict())
    first.close()
    # Windows read before the one in progress may be gone: the position names its window.
    shutil.rmtree(tmp_path / "w0")

    resumed = make_reader(tmp_path, **options)
    resumed.load_state_dict(state)
    rest = read_epoch(resumed)
    assert taken + rest == expected["w1"]
    assert read_stream(resumed) == {"w2": expected["w2"]}


def test_a_resume_at_a_window_end_needs_none_of_its_examples(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1, 2, 3])
    first = make_reader(tmp_path)
    read_epoch(first)
    state = round_trip(first.state_dict())
    assert state["position"] == {}
    shutil.rmtree(tmp_path / "w0")
    write_window(tmp_path, "w1", [10, 11])

    resumed = make_reader(tmp_path)
    resumed.load_state_dict(state)
    assert read_epoch(resumed) == []
    assert resumed.has_next_epoch()
    resumed.reset()
    assert (resumed.window, resumed.window_nr, read_epoch(resumed)) == ("w1", 2, [[[10, 11]]])


def test_a_resume_inside_a_deleted_window_names_it(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1, 2, 3])
    first = make_reader(tmp_path)
    next(first)
    state = round_trip(first.state_dict())
    shutil.rmtree(tmp_path / "w0")
    resumed = make_reader(tmp_path)
    resumed.load_state_dict(state)
    with pytest.raises(DataReaderError, match=r"load window 'w0'.*the window directory is missing"):
        next(resumed)


def test_a_load_window_error_names_the_window_and_keeps_its_cause(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1])

    def broken(path: Path) -> list[int]:
        raise OSError(f"cannot read {path.name}/part-0.json")

    with pytest.raises(DataReaderError, match=r"load window 'w0' .* cannot read w0/part-0") as info:
        next(make_reader(tmp_path, load_window=broken))
    assert isinstance(info.value.__cause__, OSError)


def test_a_window_without_examples_is_a_clear_error(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [])
    with pytest.raises(DataReaderError, match=r"load window 'w0' .* returned no examples"):
        next(make_reader(tmp_path))


def test_a_window_too_small_for_a_step_is_a_clear_error(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1, 2])
    with pytest.raises(DataReaderError, match=r"Window 'w0' .* cannot be read: The dataset is too"):
        next(make_reader(tmp_path, batch_size=4))


def test_a_missing_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataReaderError, match=r"window directory .*nowhere does not exist"):
        make_reader(tmp_path / "nowhere").has_next_epoch()


def test_an_empty_stream_is_a_clear_error(tmp_path: Path) -> None:
    mark_stopped(tmp_path)
    reader = make_reader(tmp_path)
    assert not reader.has_next_epoch()
    with pytest.raises(DataReaderError, match="No window follows in"):
        next(reader)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_windows": -3}, "max_num_windows must be greater than zero, but is -3 instead."),
        ({"poll_interval": 0}, "poll_interval must be greater than zero, but is 0 instead."),
        ({"wait_timeout": -1.0}, "wait_timeout must be greater than zero, but is -1.0 instead."),
        ({"batch_size": 0}, "batch_size must be greater than zero, but is 0 instead."),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_reader(tmp_path, **kwargs)


def test_a_windowed_reader_is_refused_for_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="validate on a reader of a fixed set"):
        make_reader(tmp_path).for_evaluation()


def test_the_device_reader_passes_the_end_of_the_stream_on(tmp_path: Path) -> None:
    write_window(tmp_path, "w0", [0, 1])
    mark_stopped(tmp_path)
    reader = DeviceDataReader(make_reader(tmp_path), torch.device("cpu"))
    assert read_epoch(reader) == [[[0, 1]]]
    assert not reader.has_next_epoch(wait=False)
