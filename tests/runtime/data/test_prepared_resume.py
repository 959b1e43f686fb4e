"""A run on prepared data resumed at another data-parallel size reads exactly the sequences the
uninterrupted run reads, and ends with the same weights: DP=2 to DP=1 and DP=1 to DP=2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gangs import Gangs
from tests.conftest import assert_ok, torchrun
from tests.runtime.data.test_prepared_reader import prepare_text
from tests.workers.prepared_resume import train

pytestmark = pytest.mark.distributed


def sequences_by_step(run: Path) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for record in sorted(run.glob("sequences_to_*_rank_*.json")):
        for step, ids in json.loads(record.read_text()).items():
            steps.setdefault(int(step), []).extend(ids)
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


def test_a_resume_at_another_dp_size_reads_the_same_sequences_and_gives_the_same_weights(
    tmp_path: Path,
) -> None:
    data = prepare_text(tmp_path / "data", [f"text number {i} " * (1 + i % 5) for i in range(120)])
    single = Gangs.single()
    train(data, tmp_path / "whole", 6, single)
    train(data, tmp_path / "one_then_two", 3, single)
    # One launch trains DP=2 to step 3 from scratch, then resumes the DP=1 run at DP=2.
    two_then_one, one_then_two = tmp_path / "two_then_one", tmp_path / "one_then_two"
    assert_ok(
        torchrun(
            2,
            "tests/workers/prepared_resume.py",
            str(data),
            f"{two_then_one}:3",
            f"{one_then_two}:6",
        )
    )
    train(data, two_then_one, 6, single)

    expected = sequences_by_step(tmp_path / "whole")
    assert list(expected) == [1, 2, 3, 4, 5, 6] and all(len(ids) == 6 for ids in expected.values())
    whole_params = torch.load(tmp_path / "whole" / "params.pt", weights_only=True)
    for run in (two_then_one, one_then_two):
        assert sequences_by_step(run) == expected, run.name
        params = torch.load(run / "params.pt", weights_only=True)
        for name, value in whole_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
