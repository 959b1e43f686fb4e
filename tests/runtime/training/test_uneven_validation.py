"""Validation and evaluation over valid sets that do not split evenly over the DP ranks.

Under FSDP2, HSDP and TP a forward makes collectives, so a rank whose shard of the valid set ran
out must still take part in the forwards of the others (with a stand-in batch whose values are
discarded). Each case compares the score with the one-process mean over the whole set, computed
in the worker (tests/workers/uneven_valid.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assert_ok, make_toy_trainer, read_jsonl, torchrun
from tests.runtime.training.test_evaluation import train_recipe

WORKER = "tests.workers.uneven_valid"
BATCH_SIZE = 4  # the worker's


def run_worker(out: Path, nproc: int, **options: Any) -> dict[str, Any]:
    assert_ok(torchrun(nproc, "-m", WORKER, str(out), json.dumps(options), timeout=300))
    result = json.loads((out / "result.json").read_text())
    assert isinstance(result, dict)
    return result


def assert_one_process_values(pairs: dict[str, list[dict[str, float]]]) -> None:
    """Each case's values equal the one-process values: every target counted exactly once."""
    assert pairs
    for case, (got, expected) in pairs.items():
        assert got["num_targets"] == expected["num_targets"], case
        assert got["mse"] == pytest.approx(expected["mse"], rel=1e-5), case


# -------------------------------------------------------------- FSDP2 on 2 ranks, every size


@pytest.fixture(scope="module")
def fsdp_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch for every case: the valid sizes 1 to 2 x DP x batch + 1, the user's readers
    that run out on one rank, and a Trainer that validates and evaluates a checkpoint."""
    sizes = list(range(1, 2 * 2 * BATCH_SIZE + 2))
    out = tmp_path_factory.mktemp("fsdp")
    return run_worker(
        out,
        2,
        layout="fsdp",
        sizes=sizes,
        iterable_sizes=[1, 9],
        user_readers=[0, 1],
        unpicklable=True,
        trainer=True,
    )


@pytest.mark.distributed
def test_every_valid_size_scores_the_one_process_mean_under_fsdp(
    fsdp_result: dict[str, Any],
) -> None:
    assert list(fsdp_result["sizes"]) == [str(size) for size in range(1, 18)]
    assert_one_process_values(fsdp_result["sizes"])
    # An IterableDataReader, sharded by hand: rank 1 reads nothing of 1 example, and one batch
    # to rank 0's two of 9.
    assert list(fsdp_result["iterable_sizes"]) == ["1", "9"]
    assert_one_process_values(fsdp_result["iterable_sizes"])


@pytest.mark.distributed
def test_a_user_reader_that_runs_out_on_one_rank_scores_the_one_process_mean(
    fsdp_result: dict[str, Any],
) -> None:
    # "1": the last rank reads one batch of three steps; "0": it reads none at all.
    assert list(fsdp_result["user_readers"]) == ["0", "1"]
    assert_one_process_values(fsdp_result["user_readers"])


@pytest.mark.distributed
def test_a_stand_in_batch_that_does_not_pickle_fails_every_rank(
    fsdp_result: dict[str, Any],
) -> None:
    # One example: rank 1 needs rank 0's batch, whose hook (a lambda) does not pickle.
    for error in fsdp_result["unpicklable"]:
        assert error.startswith("Rank 0 of the data-parallel gang could not send its batch"), error
        assert "so its batches must pickle" in error


@pytest.mark.distributed
def test_the_trainer_validates_and_evaluates_a_valid_set_smaller_than_a_train_step(
    fsdp_result: dict[str, Any],
) -> None:
    # 5 examples, read by a reader built like a training reader (batch 4, drop_remainder):
    # no step of its own on 2 ranks, but validation reads every example.
    got, expected = fsdp_result["trainer"]
    assert_one_process_values({"evaluate_checkpoint": [got, expected]})
    valid = [json.loads(line) for line in fsdp_result["trainer_valid"].splitlines()]
    assert [record.pop("step_nr") for record in valid] == [0, 1]
    assert_one_process_values(
        {f"valid {nr}": [record, expected] for nr, record in enumerate(valid)}
    )


def test_a_train_reader_too_small_for_one_step_is_still_a_clear_error(tmp_path: Path) -> None:
    trainer = make_toy_trainer(tmp_path, dataset_size=3, batch_size=4)
    with pytest.raises(ValueError, match=r"The dataset is too small: its 3 examples .* takes 4"):
        trainer.run()


# ------------------------------------------------------------------------- other layouts


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "sizes"),
    [("hsdp", [1, 5, 17, 33]), ("fsdp_tp", [1, 9, 17])],
    ids=["hsdp2x2", "fsdp2_x_tp2"],
)
def test_uneven_valid_sets_score_the_one_process_mean_in_4_rank_layouts(
    tmp_path: Path, layout: str, sizes: list[int]
) -> None:
    result = run_worker(tmp_path, 4, layout=layout, sizes=sizes, user_readers=[0, 1])
    assert_one_process_values(result["sizes"])
    assert_one_process_values(result["user_readers"])


@pytest.mark.slow
@pytest.mark.distributed
def test_stand_in_forwards_run_through_compiled_blocks(tmp_path: Path) -> None:
    result = run_worker(tmp_path, 2, layout="fsdp", sizes=[1, 9], compile=True)
    assert result["compiled"] == 2
    assert_one_process_values(result["sizes"])


@pytest.mark.slow
@pytest.mark.distributed
def test_the_evaluate_flag_under_fsdp_on_an_uneven_valid_set(tmp_path: Path) -> None:
    # 9 valid examples in batches of 4 on 2 ranks: rank 0 reads two batches, rank 1 one.
    valid = train_recipe(tmp_path, valid_size=9)
    result = torchrun(
        2,
        "-m",
        "tests.workers.valid_toy",
        str(tmp_path),
        "--config",
        "data_parallel=fsdp",
        "valid_size=9",
        "--evaluate",
        "6",
        timeout=300,
    )
    assert_ok(result)
    (record,) = read_jsonl(tmp_path / "metrics" / "eval.jsonl")
    assert record.pop("step_nr") == 6
    assert record == pytest.approx(valid[6], rel=1e-5)
