"""The console progress display: a rich bar on a terminal, silence elsewhere."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from runtime import ProgressDisplay, make_progress_display
from runtime.metrics.progress import LossAverage, RichProgressDisplay


def test_rich_display_shows_the_step_and_the_published_values() -> None:
    out = io.StringIO()
    display = RichProgressDisplay(Console(file=out, force_terminal=True, width=120))
    display.start(total_steps=100, initial_step=40)
    display.advance(step_nr=50)
    display.update_values({"loss": 2.3456, "lr": 0.001})
    display.close()
    text = out.getvalue()
    assert "50/100" in text
    assert "loss 2.346" in text and "lr 0.001" in text


def test_without_a_terminal_the_display_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    # Under pytest stderr is captured, so it is not a terminal: the plain log lines report.
    display = make_progress_display(enabled=True)
    assert type(display) is ProgressDisplay
    display.start(total_steps=10, initial_step=0)
    display.advance(step_nr=1)
    display.close()
    assert capsys.readouterr().err == ""


def test_disabled_display_is_silent_even_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert type(make_progress_display(enabled=False)) is ProgressDisplay


def test_rich_display_shows_the_moving_average_of_the_loss() -> None:
    out = io.StringIO()
    display = RichProgressDisplay(Console(file=out, force_terminal=True, width=160))
    display.start(total_steps=100, initial_step=0)
    for loss in (4.0, 2.0, 3.0):
        display.update_values({"loss": loss, "lr": 0.001})
    display.close()
    assert "loss 3  loss_avg 3" in out.getvalue()


def test_loss_average_covers_the_last_publishes_only() -> None:
    average = LossAverage(window=2)
    assert average.add(4.0) == 4.0
    assert average.add(2.0) == 3.0
    assert average.add(8.0) == 5.0
