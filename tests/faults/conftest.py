"""The fault suite's shared pieces: the uninterrupted reference run and the table of figures.

Each case records how many trials it ran, how many the run survived (every invariant held) and
how much committed data was lost; ``pytest -m faults`` prints them as the README's table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from subprocess import CompletedProcess

import pytest
from torch import Tensor

from tests.faults.jobs import load_params


@dataclass
class Tally:
    case: str
    trials: int = 0
    survived: int = 0
    data_lost: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, *, survived: bool, data_lost: int = 0, detail: str = "") -> None:
        self.trials += 1
        self.survived += int(survived)
        self.data_lost += data_lost
        if not survived:
            self.failures.append(f"trial {self.trials}: {detail}")

    def check(self) -> None:
        assert self.survived == self.trials and self.data_lost == 0, "\n".join(self.failures)


_TALLIES: list[Tally] = []


@pytest.fixture
def tally(request: pytest.FixtureRequest) -> Tally:
    """The figures of this case; call ``check()`` at the end of the test."""
    result = Tally(request.node.name)
    _TALLIES.append(result)
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _TALLIES:
        return
    terminalreporter.section("fault suite: trials, survived, committed data lost")
    for t in _TALLIES:
        terminalreporter.write_line(
            f"{t.case}: {t.trials} trials, {t.survived} survived, {t.data_lost} lost"
        )


@pytest.fixture(scope="session")
def reference(preempted_dp2: tuple[Path, CompletedProcess[str]]) -> dict[str, Tensor]:
    """The final parameters of the uninterrupted dp2 run every trial must reproduce exactly: the
    reference of the session's preempted dp2 launch (its config is :data:`DP2`'s, as every
    trial's)."""
    return load_params(preempted_dp2[0] / "reference")


def trial_counts(default: int, slow: int) -> list[object]:
    """``default`` trials in ``make test``, ``slow`` more in ``make test-all``."""
    return [
        pytest.param(default, id=f"{default}_trials"),
        pytest.param(slow, id=f"{slow}_trials", marks=pytest.mark.slow),
    ]


def out_dir(tmp_path: Path, trial: int) -> Path:
    return tmp_path / f"trial_{trial}"
