"""Several two-rank checks of other workers in one ``torchrun`` launch, so their tests share one
start-up: each check runs in turn over the same gangs and each rank writes
``OUT/CHECK/rank_R.json``.

Usage: ``torchrun --nproc-per-node 2 tests/workers/two_rank_checks.py OUT``. The checks: every
two-rank mode of ``checkpoint_check.py`` (by its name), ``agreement`` (``agreement_check.py``) and
``readers`` (``tests/runtime/data/data_worker.py``).
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
from tests.workers import agreement_check, checkpoint_check
from tests.workers.leave import leave

CHECKS: dict[str, Callable[[Path, Gangs], Any]] = {
    **checkpoint_check.MODES,
    "agreement": lambda _, gangs: agreement_check.check(gangs.root),
    "readers": lambda _, gangs: data_worker.check(gangs.dp),
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
        (check_dir / f"rank_{rank}.json").write_text(json.dumps(result))
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
