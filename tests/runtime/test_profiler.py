"""The torch.profiler window: traces of the recorded steps land in profile_dir/rank_N."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gangs import FakeGang
from runtime import TorchProfiler
from tests.conftest import make_toy_trainer


def test_trainer_writes_a_trace_of_the_recorded_steps(tmp_path: Path) -> None:
    profiler = TorchProfiler(
        num_skip_steps=1, num_record_steps=2, profile_dir=tmp_path / "profile", gang=FakeGang()
    )
    trainer = make_toy_trainer(tmp_path, max_num_steps=6, profiler=profiler)
    assert trainer.run() == 0

    (trace_file,) = (tmp_path / "profile" / "rank_0").glob("*.pt.trace.json*")
    events = json.loads(trace_file.read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    # One skipped step and one warm-up step come before the two recorded ones.
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any(e.get("name") == "aten::mm" for e in events)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_skip_steps": -1}, "num_skip_steps must be zero or more, but is -1 instead."),
        ({"num_record_steps": 0}, "num_record_steps must be greater than zero, but is 0 instead."),
    ],
)
def test_bad_windows_are_clear_errors(tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    arguments = {"num_skip_steps": 0, "num_record_steps": 1} | kwargs
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        TorchProfiler(**arguments, profile_dir=tmp_path, gang=FakeGang())
