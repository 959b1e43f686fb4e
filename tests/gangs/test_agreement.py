"""The agreement helpers: a failure anywhere raises everywhere; rank 0 decides, all follow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gangs import (
    FakeGang,
    ReduceOperation,
    agree,
    decide_on_rank_zero,
    find_disagreements,
    run_on_all_ranks,
)
from tests.conftest import TwinRanksGang


def test_one_process_agrees_with_itself() -> None:
    gang = FakeGang()
    assert agree(gang, failed=False, vote=3, vote_op=ReduceOperation.MIN) == (False, 3)
    assert run_on_all_ranks(gang, lambda: 5, what="count") == 5
    assert decide_on_rank_zero(gang, lambda: [1, 2], on_failure=RuntimeError) == [1, 2]
    assert find_disagreements(gang, {"a": 1}) == {}
    with pytest.raises(ValueError, match="Failed to count on rank 0: 'boom'"):
        run_on_all_ranks(gang, lambda: {}["boom"], what="count", error_type=ValueError)
    with pytest.raises(ValueError, match="vote_op must be MIN or MAX"):
        agree(gang, failed=False, vote_op=ReduceOperation.SUM)


@pytest.mark.distributed
def test_two_ranks_agree_on_failures_votes_and_decisions(two_rank_checks: Path) -> None:
    out = two_rank_checks / "agreement"
    reports = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["agree_min"] == [False, 1]
        assert report["agree_max"] == [True, 2]
        assert report["all_ok"] == rank * 10
        assert report["rank_zero_decides"] == "decided by 0"
        assert report["disagreements"] == {"rank": [0, 1]}
    # The failed rank names the cause; the other learns that a rank failed instead of hanging.
    assert reports[1]["failure"] == "Failed to write on rank 1: disk on fire"
    assert reports[0]["failure"] == "Failed to write on another rank; see that rank's log."
    # Rank 0 raises its own error; the others raise the one on_failure makes of it.
    assert reports[0]["decision_failure"] == "KeyError: 'no such score'"
    assert reports[1]["decision_failure"] == "ValueError: stopper: KeyError: 'no such score'"


def test_agreement_makes_no_collective_on_the_compute_device() -> None:
    """On a CUDA gang, agreeing runs on CPU tensors (gloo): no host sync, no NCCL call."""
    gang = TwinRanksGang(torch.device("cuda", 0))
    assert agree(gang, failed=False, vote=4, vote_op=ReduceOperation.MIN) == (False, 4)
    assert find_disagreements(gang, {"a": 1, "b": 2}) == {}
    assert gang.collective_devices == [torch.device("cpu")] * 2
