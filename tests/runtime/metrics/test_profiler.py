"""The torch.profiler window: traces of the recorded steps land in profile_dir/rank_N."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
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


def test_the_trace_names_each_part_of_the_recorded_steps(tmp_path: Path) -> None:
    from runtime.metrics import tracing

    profiler = TorchProfiler(
        num_skip_steps=1, num_record_steps=2, profile_dir=tmp_path / "profile", gang=FakeGang()
    )
    # Steps 3 and 4 are recorded; step 4 validates and checkpoints, steps 2 and 6 do too.
    trainer = make_toy_trainer(
        tmp_path,
        max_num_steps=6,
        num_accumulate=2,
        profiler=profiler,
        checkpoint_every_n_steps=2,
    )
    assert trainer.run() == 0

    (trace_file,) = (tmp_path / "profile" / "rank_0").glob("*.pt.trace.json*")
    names = [e.get("name") for e in json.loads(trace_file.read_text())["traceEvents"]]
    per_micro_batch = {tracing.FORWARD: 4, tracing.BACKWARD: 4}
    per_step = {tracing.DATA_WAIT: 2, tracing.GRADIENT_SYNC: 2, tracing.OPTIMIZER_STEP: 2}
    for name, count in (per_micro_batch | per_step | {tracing.CHECKPOINT: 1}).items():
        assert names.count(name) == count, name


def test_the_trace_names_the_validation_of_a_recorded_step(tmp_path: Path) -> None:
    from runtime.metrics import tracing
    from tests.runtime.training.test_validation import make_trainer

    profiler = TorchProfiler(
        num_skip_steps=1, num_record_steps=2, profile_dir=tmp_path / "profile", gang=FakeGang()
    )
    # Validations after steps 2, 4 and 6: only step 4's is in the recorded steps 3 and 4.
    trainer = make_trainer(tmp_path, validate_every_n_steps=2, profiler=profiler)
    assert trainer.run() == 0

    (trace_file,) = (tmp_path / "profile" / "rank_0").glob("*.pt.trace.json*")
    names = [e.get("name") for e in json.loads(trace_file.read_text())["traceEvents"]]
    assert names.count(tracing.VALIDATION) == 1
    assert names.count(tracing.FORWARD) == 2


def _entered_ranges(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the ranges entered from here on, in their order (instead of the trace)."""
    from runtime.metrics import tracing

    entered: list[str] = []

    @contextlib.contextmanager
    def record(name: str) -> Iterator[None]:
        entered.append(name)
        yield

    monkeypatch.setattr(tracing, "record_function", record)
    return entered


def test_a_run_without_a_profiler_enters_no_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.metrics import tracing
    from tests.runtime.training.test_validation import make_trainer

    entered = _entered_ranges(monkeypatch)
    # Steps, a validation and checkpoints: every part that marks a range, none of them marked.
    trainer = make_trainer(
        tmp_path, max_num_steps=2, validate_every_n_steps=2, checkpoint_every_n_steps=2
    )
    assert trainer.run() == 0
    assert entered == []
    # The ranges are one shared no-op context.
    ranges = tracing.trace_ranges(False)
    assert ranges(tracing.FORWARD) is ranges(tracing.CHECKPOINT)


def test_a_run_with_a_profiler_enters_the_ranges_of_each_step_in_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.metrics import tracing

    entered = _entered_ranges(monkeypatch)
    profiler = TorchProfiler(
        num_skip_steps=0, num_record_steps=1, profile_dir=tmp_path / "profile", gang=FakeGang()
    )
    trainer = make_toy_trainer(
        tmp_path, max_num_steps=2, num_accumulate=2, profiler=profiler, checkpoint_every_n_steps=2
    )
    assert trainer.run() == 0
    micro_batch = [tracing.FORWARD, tracing.BACKWARD]
    step = [tracing.DATA_WAIT, *micro_batch, *micro_batch]
    step += [tracing.GRADIENT_SYNC, tracing.OPTIMIZER_STEP]
    assert entered == [*step, *step, tracing.CHECKPOINT]
