"""Checkpoint save, load and async-save blocking time against plain DCP, at 1 and 2 ranks."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings
from benchmarks.runner import Comparison, Contender, Metric

KEY = "checkpoint"
PLAIN_DCP = "plain DCP"
METRICS = (
    Metric("save_s", "save", "s"),
    Metric("load_s", "load", "s"),
    Metric("async_blocked_s", "async save, caller blocked", "s"),
    Metric("async_blocked_later_s", "a later async save, caller blocked", "s"),
)


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    size = settings.checkpoint_params_millions
    # Parameters, and two AdamW moments of the same size, in float32.
    size_mb = size * 1e6 * 4 * 3 / 1e6
    return [
        Comparison(
            key=f"{KEY}-{nproc}",
            title=f"checkpoint of {size:g}M parameters with AdamW state ({size_mb:.0f} MB), "
            f"{nproc} rank{'s' if nproc > 1 else ''}",
            baseline=PLAIN_DCP,
            metrics=METRICS,
            contenders=tuple(
                Contender(
                    name=name,
                    module="benchmarks.checkpoint_worker",
                    args=("--tool", tool, "--params-millions", str(size)),
                    nproc=nproc,
                )
                for name, tool in ((PLAIN_DCP, "dcp"), ("this project", "project"))
            ),
            notes=(
                "Blocked time of an async save: the call, plus waiting for the save (and its "
                "commit) at the next checkpoint, after the write had time to finish. The first "
                "async save of the process, and the one after it.",
            ),
        )
        for nproc in (1, 2)
    ]
