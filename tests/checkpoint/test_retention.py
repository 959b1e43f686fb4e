"""Retention after many saves: exactly the right checkpoints survive, in each combination."""

from __future__ import annotations

from dataclasses import replace

import pytest

from checkpoint import CheckpointInfo, RetentionPolicy, best_checkpoint, plan_retention

# Scores of steps 10..100: best (lowest) at 30, then 70, then 50.
SCORES = {10: 5.0, 20: 4.0, 30: 1.0, 40: 3.5, 50: 2.0, 60: 3.0, 70: 1.5, 80: 2.5, 90: 2.7, 100: 2.6}


def infos(kinds: dict[int, str] | None = None) -> list[CheckpointInfo]:
    kinds = kinds or {}
    return [
        CheckpointInfo(step_nr=s, score=score, kind=kinds.get(s, "full"), size_bytes=1)  # type: ignore[arg-type]
        for s, score in SCORES.items()
    ]


def test_no_limit_keeps_everything() -> None:
    plan = plan_retention(infos(), RetentionPolicy())
    assert plan.keep == set(SCORES) and not plan.delete and not plan.prune_to_model


def test_keep_last() -> None:
    plan = plan_retention(infos(), RetentionPolicy(keep_last_n_checkpoints=3))
    assert plan.keep == {80, 90, 100}
    assert plan.delete == set(SCORES) - {80, 90, 100}


@pytest.mark.parametrize(
    ("lower_better", "best"),
    [(True, {30, 70, 50}), (False, {10, 20, 40})],
)
def test_keep_best_in_both_orientations_plus_the_newest(lower_better: bool, best: set[int]) -> None:
    plan = plan_retention(
        infos(), RetentionPolicy(keep_best_n_checkpoints=3), lower_better=lower_better
    )
    assert plan.keep == best | {100}


def test_keep_last_and_best_is_a_union() -> None:
    plan = plan_retention(
        infos(), RetentionPolicy(keep_last_n_checkpoints=2, keep_best_n_checkpoints=2)
    )
    assert plan.keep == {90, 100, 30, 70}
    assert plan.delete == set(SCORES) - {90, 100, 30, 70}


def test_models_outlive_their_checkpoints() -> None:
    plan = plan_retention(
        infos(),
        RetentionPolicy(
            keep_last_n_checkpoints=2,
            keep_last_n_models=4,
            keep_best_n_models=1,
        ),
    )
    assert plan.keep == {70, 80, 90, 100, 30}
    assert plan.prune_to_model == {70, 80, 30}
    assert plan.delete == {10, 20, 40, 50, 60}


def test_already_pruned_models_are_not_pruned_again() -> None:
    plan = plan_retention(
        infos({80: "model"}), RetentionPolicy(keep_last_n_checkpoints=2, keep_last_n_models=3)
    )
    assert plan.prune_to_model == set()
    assert plan.keep == {80, 90, 100}


def test_keep_best_ignores_unscored_checkpoints_and_keeps_the_newest() -> None:
    unscored = [CheckpointInfo(step_nr=s, score=None, kind="full", size_bytes=1) for s in (1, 2, 3)]
    plan = plan_retention(unscored, RetentionPolicy(keep_best_n_checkpoints=2))
    assert plan.keep == {3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"keep_last_n_checkpoints": 0},
            "keep_last_n_checkpoints must be greater than zero, but is 0",
        ),
        ({"keep_best_n_models": -1}, "keep_best_n_models must be greater than zero, but is -1"),
        (
            {"keep_last_n_checkpoints": 3, "keep_last_n_models": 2},
            r"keep_last_n_models must be at least keep_last_n_checkpoints \(3\)",
        ),
    ],
)
def test_contradictions_are_errors(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


def test_unhealthy_checkpoints_are_neither_last_nor_best_and_are_kept() -> None:
    unhealthy = {70, 80, 90, 100}
    marked = [replace(i, healthy=i.step_nr not in unhealthy) for i in infos()]
    plan = plan_retention(
        marked,
        RetentionPolicy(keep_last_n_checkpoints=1, keep_best_n_checkpoints=1, keep_last_n_models=2),
    )
    # Last: 60 (the newest healthy); best: 30 (70 scores better but is unhealthy); model: 50.
    assert plan.keep == {30, 50, 60} | unhealthy
    assert plan.prune_to_model == {50}
    assert best_checkpoint(marked, lower_better=True) == marked[2]


def test_snapshots_every_n_steps_are_kept_whole() -> None:
    policy = RetentionPolicy(
        keep_last_n_checkpoints=1, keep_last_n_models=3, keep_checkpoint_every_n_steps=40
    )
    plan = plan_retention([replace(i, permanent=i.step_nr == 10) for i in infos()], policy)
    assert plan.keep == {10, 40, 80, 90, 100}
    assert plan.prune_to_model == {90}  # 80 is a snapshot: kept whole
