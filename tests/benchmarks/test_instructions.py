"""The instruction-count case: the window it counts, and the case end to end (slow: callgrind)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.probe as probe
from benchmarks.instructions_worker import missing_tool
from benchmarks.probe import StepTimer, watch_timed_steps
from tests.conftest import assert_ok, run_quick_benchmark


def test_the_window_hooks_see_the_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "_window_hooks", None)
    events: list[tuple[str, int]] = []
    timer = StepTimer(num_warmup=2, num_steps=5)
    steps_ended = [0]
    watch_timed_steps(
        begin=lambda: events.append(("begin", steps_ended[0])),
        end=lambda: events.append(("end", steps_ended[0])),
    )
    for step_nr in range(1, 6):
        steps_ended[0] = step_nr
        timer.step_end()
    # Counting starts after the last warm-up step and stops after the last step: steps 3 to 5,
    # the ones seconds_per_step divides by.
    assert events == [("begin", 2), ("end", 5)]


def test_a_host_without_valgrind_skips_the_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert missing_tool() == "valgrind is not installed (it comes with valgrind)"


@pytest.mark.slow
@pytest.mark.skipif(missing_tool() is not None, reason="valgrind is not installed")
def test_the_trainer_costs_more_instructions_than_the_hand_written_loop(tmp_path: Path) -> None:
    assert_ok(run_quick_benchmark("W1-instructions", tmp_path, timeout=900))
    [comparison] = json.loads((tmp_path / "results.json").read_text())["comparisons"]
    contenders = {c["name"]: c for c in comparison["contenders"]}
    assert list(contenders) == [
        "hand-written",
        "hand-written + the Trainer's work",
        "this project",
    ]
    for contender in contenders.values():
        assert contender["status"] == "ok", contender["note"]
    counts = {
        name: c["metrics"]["instructions_per_step"]["median"] for name, c in contenders.items()
    }
    # An MLP step is a few million instructions; the Trainer's work adds to them, never removes.
    assert 1e6 < counts["hand-written"] < counts["this project"]
    assert "| this project |" in (tmp_path / "results.md").read_text()
