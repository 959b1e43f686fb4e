"""The checkpoint cases: a state of at least 1 GB by default, shaped like a transformer's, saved
and loaded by plain DCP and by the project on each of its two ways through DCP, and loaded on
both ways taking turns in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import parse_args
from benchmarks.cases import CASE_KEYS, SuiteSettings, checkpoint, checkpoint_loads
from tests.conftest import assert_ok, run_quick_benchmark


def test_by_default_the_checkpoint_case_saves_over_a_gigabyte_on_both_paths() -> None:
    args = parse_args([])
    params = checkpoint.num_params(checkpoint.model_dim(args.checkpoint_params_millions))
    assert params * 4 * 3 >= 1e9  # float32 parameters and two AdamW moments
    settings = SuiteSettings(
        quick=False, checkpoint_params_millions=args.checkpoint_params_millions
    )
    one_rank, two_ranks = checkpoint.comparisons(settings)
    assert (one_rank.contenders[0].nproc, two_ranks.contenders[0].nproc) == (1, 2)
    assert "(1.19 GB)" in one_rank.title
    assert [c.name for c in one_rank.contenders] == [
        "plain DCP",
        "this project, fast path",
        "this project, public path",
    ]
    size = ("--params-millions", "100.0")
    assert [c.args for c in one_rank.contenders] == [
        ("--tool", "dcp", *size),
        ("--tool", "project", "--checkpoint-io", "fast", *size),
        ("--tool", "project", "--checkpoint-io", "public", *size),
    ]
    assert {"checkpoint", "checkpoint-loads"} <= set(CASE_KEYS)
    [loads, _] = checkpoint_loads.comparisons(settings)
    assert loads.contenders[0].args == ("--tool", "project-loads", "--rounds", "6", *size)


def test_the_model_has_the_size_the_case_names() -> None:
    from benchmarks.checkpoint_worker import make_model

    model = make_model(2.0)
    assert sum(p.numel() for p in model.parameters()) == checkpoint.num_params(96)
    assert checkpoint.model_dim(2.0) == 96
    assert len(list(model.parameters())) == 111


@pytest.mark.slow
def test_the_checkpoint_cases_time_every_contender(tmp_path: Path) -> None:
    assert_ok(run_quick_benchmark("checkpoint,checkpoint-loads", tmp_path))
    comparisons = json.loads((tmp_path / "results.json").read_text())["comparisons"]
    assert [c["key"] for c in comparisons] == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-loads-1",
        "checkpoint-loads-2",
    ]
    for comparison in comparisons:
        keys = [metric["key"] for metric in comparison["metrics"]]
        for contender in comparison["contenders"]:
            assert contender["status"] == "ok", contender["note"]
            for key in keys:
                assert contender["metrics"][key]["median"] > 0, key
