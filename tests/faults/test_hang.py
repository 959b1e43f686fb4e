"""A rank that hangs: the others fail within the gang timeout and say who, where and when."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import public_torch_path_in_test_all
from tests.faults.conftest import Tally, trial_counts
from tests.faults.jobs import rank_log, run_job

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


@pytest.mark.parametrize("trials", trial_counts(1, 3))
@public_torch_path_in_test_all  # the store the ranks report to
def test_a_hung_rank_is_named_with_the_collective_and_the_step(
    trials: int, tmp_path: Path, tally: Tally
) -> None:
    # Trial t: rank (t + 1) % 2 stops calling collectives after step 2 + t; the other rank's next
    # collective times out after 3 s.
    for trial in range(trials):
        out = tmp_path / f"trial_{trial}"
        hung_rank, hang_step = (trial + 1) % 2, 2 + trial
        waiting_rank = 1 - hung_rank
        result = run_job(
            out, f"hang_at_step={hang_step}", f"fault_rank={hung_rank}", "gang_timeout_seconds=3"
        )
        # The timeout strikes in the next collective: a gang's (publishing metrics after the
        # step) or one inside torch (DDP's gradient all-reduce in the next step's backward).
        expected = re.compile(
            rf"error: The run failed at step (?:{hang_step}|{hang_step + 1}): "
            rf"(?:The \w+ collective|A collective in torch\.\S+ \(called from [\w.]+:\d+ \w+\)) "
            rf"timed out on rank {waiting_rank} of a gang of 2(?: after [\d:]+)?: "
            rf"rank {hung_rank} of the gang did not reach it"
        )
        ok = (
            result.returncode != 0
            and expected.search(result.stderr) is not None
            and "timed out" in rank_log(out, waiting_rank)
        )
        tally.add(survived=ok, detail=f"exit {result.returncode}\n{result.stderr[-4000:]}")
    tally.check()
