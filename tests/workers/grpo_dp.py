"""A GRPO run of ``recipes.lm`` on two ranks with gradient accumulation, for the test that one
process with the whole batch takes the same steps (``tests/recipes/test_grpo.py``).

Rank 0 writes the model and the prompts under OUT; both ranks then train into ``OUT/run``.
Standalone: ``torchrun --nproc-per-node 2 tests/workers/grpo_dp.py OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gangs import Gangs, setup_gangs
from tests.recipes.test_grpo import accumulation_run, run_in_process


def run(out: Path, gangs: Gangs) -> None:
    config = accumulation_run(out, dp_size=2, write=gangs.root.rank == 0)
    gangs.root.barrier()
    run_in_process(config, out / "run", gangs)


if __name__ == "__main__":
    from tests.workers.leave import leave

    gangs = setup_gangs()
    run(Path(sys.argv[1]), gangs)
    leave(gangs.root)
