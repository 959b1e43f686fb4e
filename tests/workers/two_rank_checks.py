"""Several two-rank checks of other workers in one ``torchrun`` launch, so their tests share one
start-up: each check runs in turn over the same gangs and each rank writes
``OUT/CHECK/rank_R.json``.

Usage: ``torchrun --nproc-per-node 2 tests/workers/two_rank_checks.py OUT``. The checks: every
two-rank mode of ``checkpoint_check.py`` (by its name), ``agreement`` (``agreement_check.py``),
``readers`` (``tests/runtime/data/data_worker.py``), ``equivalence``, ``good_runs`` and ``norm_runs`` (runs
of ``train_toy.py``), ``collectives`` (``collective_count.py`` under DDP and FSDP2), ``host_sync``
(make test's layouts), ``large_model`` (cases of ``large_model.py``), ``preference_dp`` (a DPO
run of ``recipes.lm``), ``grpo_dp`` (a GRPO one), ``expert_parallel``, ``sequence_parallel``
(Ulysses attention) and ``ddp_options``. The runs
and cases are those the tests define. A check that writes its own files returns None.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gangs import Gangs, setup_gangs
from tests.runtime.data import data_worker
from tests.runtime.parallel.test_large_models import TWO_PROCESS_CASES
from tests.runtime.parallel.test_wrapping import DDP_CASES
from tests.runtime.training.test_gradients import NORM_RUNS
from tests.runtime.training.test_host_sync_distributed import FAST_LAYOUTS
from tests.runtime.training.test_non_finite import GOOD_RUNS
from tests.runtime.training.test_trainer_equivalence import RUNS
from tests.workers import (
    agreement_check,
    checkpoint_check,
    collective_count,
    ddp_options,
    expert_parallel,
    grpo_dp,
    host_sync,
    large_model,
    preference_dp,
    sequence_parallel,
    train_toy,
)
from tests.workers.leave import leave

CHECKS: dict[str, Callable[[Path, Gangs], Any]] = {
    **checkpoint_check.MODES,
    "agreement": lambda _, gangs: agreement_check.check(gangs.root),
    "readers": lambda _, gangs: data_worker.check(gangs.dp),
    "equivalence": lambda out, gangs: train_toy.run_all(gangs.root, out, RUNS[2]),
    "good_runs": lambda out, gangs: train_toy.run_all(gangs.root, out, GOOD_RUNS),
    "norm_runs": lambda out, gangs: train_toy.run_all(gangs.root, out, NORM_RUNS),
    "collectives": lambda out, gangs: collective_count.count_kinds(gangs, out, ["ddp", "fsdp"]),
    "host_sync": lambda out, gangs: host_sync.run_all(gangs.root, out, FAST_LAYOUTS),
    "large_model": lambda out, gangs: large_model.run_all(gangs.root, out, TWO_PROCESS_CASES),
    "preference_dp": preference_dp.run,
    "grpo_dp": grpo_dp.run,
    "expert_parallel": lambda out, gangs: expert_parallel.run_all(gangs.root, out),
    "sequence_parallel": lambda _, gangs: sequence_parallel.run(gangs),
    # Last: the case DDP refuses leaves its reducer mid-iteration.
    "ddp_options": lambda out, gangs: ddp_options.run_all(gangs, out, DDP_CASES),
}


def main(output_dir: Path) -> None:
    gangs = setup_gangs()
    rank = int(os.environ["RANK"])
    for name, check in CHECKS.items():
        check_dir = output_dir / name
        check_dir.mkdir(parents=True, exist_ok=True)
        try:
            result = check(check_dir, gangs)
        except BaseException as ex:
            ex.add_note(f"(in two_rank_checks.py's check {name})")
            raise
        if result is not None:
            (check_dir / f"rank_{rank}.json").write_text(json.dumps(result))
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
