"""W1 paired: the Trainer's cost over the hand-written loop, on a host too noisy for W1's ratio."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings
from benchmarks.runner import Comparison, Contender, Metric

KEY = "W1-paired"

PAIRED = "this project, taking turns with the hand-written loop"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        paired_comparison(
            key=KEY,
            title="W1, the Trainer and the hand-written loop taking turns in one process",
            settings=settings,
        )
    ]


def paired_comparison(
    *, key: str, title: str, settings: SuiteSettings, nproc: int = 1
) -> Comparison:
    """The Trainer and the hand-written loop taking turns on W1's workload in ``nproc``
    processes (DDP over gloo when more than one)."""
    notes = [
        "The loops alternate in blocks of 50 steps (10 with --quick); each Trainer block is "
        "compared with the mean of the hand-written blocks before and after it, so each pair "
        "sees the same moment of the host. Each figure is the median over the blocks of a "
        "process; the table gives the median of the processes."
    ]
    if nproc > 1:
        notes.append(
            f"Every one of the {nproc} ranks takes the same turns; the hand-written loop is DDP "
            "on the Trainer's process group. The figures are rank 0's."
        )
    return Comparison(
        key=key,
        title=title,
        baseline=PAIRED,
        metrics=(
            Metric("trainer_step_s", "Trainer step", "s", ratio=False),
            Metric("hand_step_s", "hand-written step", "s", ratio=False),
            Metric("extra_s", "Trainer step - hand-written step", "s", ratio=False),
            Metric("ratio", "Trainer step / hand-written step", "ratio", ratio=False),
        ),
        contenders=(
            Contender(
                name=PAIRED,
                module="benchmarks.paired_worker",
                args=("--quick",) if settings.quick else (),
                nproc=nproc,
            ),
        ),
        notes=tuple(notes),
    )
