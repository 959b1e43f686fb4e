"""Exercise the agreement helpers under ``torchrun``; each rank writes what it saw as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gangs import (
    Gang,
    ReduceOperation,
    agree,
    decide_on_rank_zero,
    find_disagreements,
    run_on_all_ranks,
    setup_gangs,
)
from tests.workers.leave import leave


def fail_on(rank: int, failing_rank: int) -> str:
    if rank == failing_rank:
        raise OSError("disk on fire")
    return "done"


def check(gang: Gang) -> dict[str, object]:
    """What this rank of ``gang`` saw of each agreement helper."""
    rank = gang.rank
    report: dict[str, object] = {
        "agree_min": agree(gang, failed=False, vote=rank + 1, vote_op=ReduceOperation.MIN),
        "agree_max": agree(gang, failed=rank == 1, vote=rank + 1, vote_op=ReduceOperation.MAX),
        "all_ok": run_on_all_ranks(gang, lambda: rank * 10, what="multiply"),
        "rank_zero_decides": decide_on_rank_zero(
            gang, lambda: f"decided by {rank}", on_failure=RuntimeError
        ),
        "disagreements": find_disagreements(gang, {"same": 3, "rank": rank}),
    }
    try:
        run_on_all_ranks(gang, lambda: fail_on(rank, 1), what="write", error_type=ValueError)
    except ValueError as ex:
        report["failure"] = str(ex)

    def decide() -> bool:
        raise KeyError("no such score")

    try:
        decide_on_rank_zero(gang, decide, on_failure=lambda cause: ValueError(f"stopper: {cause}"))
    except (KeyError, ValueError) as ex:
        report["decision_failure"] = f"{type(ex).__name__}: {ex}"
    return report


def main(output_dir: Path) -> None:
    gang = setup_gangs().root
    (output_dir / f"rank_{gang.rank}.json").write_text(json.dumps(check(gang)))
    leave(gang)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
