"""A GRPO run of ``recipes.lm`` on two ranks with gradient accumulation, for the test that one
process with the whole batch takes the same steps (``tests/recipes/test_grpo.py``).

Rank 0 writes the model and the prompts under OUT; both ranks then train into
``OUT/run_group`` and, with ``grpo.scale_rewards=batch``, ``OUT/run_batch``; or, given loss
types, one run of each into ``OUT/run_loss_<type>``.
Standalone: ``torchrun --nproc-per-node 2 tests/workers/grpo_dp.py OUT [LOSS_TYPE...]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gangs import Gangs, setup_gangs
from tests.recipes.test_grpo import accumulation_run, run_in_process


def run(out: Path, gangs: Gangs, loss_types: list[str] | None = None) -> None:
    if gangs.root.rank == 0:
        accumulation_run(out, dp_size=2)
    gangs.root.barrier()
    if loss_types:
        for loss_type in loss_types:
            config = accumulation_run(out, dp_size=2, write=False, loss_type=loss_type)
            run_in_process(config, out / f"run_loss_{loss_type}", gangs)
        return
    for scale_rewards in ("group", "batch"):
        config = accumulation_run(out, dp_size=2, write=False, scale_rewards=scale_rewards)
        run_in_process(config, out / f"run_{scale_rewards}", gangs)


if __name__ == "__main__":
    from tests.workers.leave import leave

    gangs = setup_gangs()
    run(Path(sys.argv[1]), gangs, sys.argv[2:])
    leave(gangs.root)
