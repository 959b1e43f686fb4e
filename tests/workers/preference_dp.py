"""A DPO run of ``recipes.lm`` on two ranks with gradient accumulation, for the test that one
process with the whole batch takes the same steps (``tests/recipes/test_preference.py``).

Rank 0 writes the model and the pairs under OUT; both ranks then train into ``OUT/run``.
"""

from __future__ import annotations

from pathlib import Path

from gangs import Gangs
from tests.recipes.test_preference import accumulation_run, run_in_process


def run(out: Path, gangs: Gangs) -> None:
    config = accumulation_run(out, dp_size=2, write=gangs.root.rank == 0)
    gangs.root.barrier()
    run_in_process(config, out / "run", gangs)
