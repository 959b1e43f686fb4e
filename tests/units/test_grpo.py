"""GRPO's pieces on their own: loading and calling reward functions, the advantages of each
scaling, and the sum and count of each loss type. (The whole unit against TRL:
test_grpo_trl.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from units.grpo import (
    RewardFunctionError,
    RewardFunctions,
    RewardState,
    advantages_of,
    load_reward_function,
    reduce_token_losses,
)

TRL_METRICS = frozenset(
    {
        "loss",
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/clipped_ratio",
    }
)
"""What TRL's GRPOTrainer publishes, besides ``kl`` (with ``beta > 0``) and each reward
function's mean."""


def lengths(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def test_a_reward_function_is_loaded_by_import_path_or_refused_in_one_line() -> None:
    assert load_reward_function("tests.units.test_grpo:lengths") is lengths
    for path, message in [
        ("tests.units.test_grpo", 'named "package.module:function"'),
        ("tests.units.no_such_module:f", "cannot import tests.units.no_such_module"),
        ("tests.units.test_grpo:missing", "has no function missing"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            load_reward_function(path)
        assert "\n" not in str(info.value)


def test_reward_functions_get_trls_arguments_and_their_weighted_scores() -> None:
    seen: dict[str, Any] = {}

    def spy(**kwargs: Any) -> list[float | None]:
        seen.update(kwargs)
        return [1.0, None]

    rewards = RewardFunctions.of({"spy": spy, "lengths": lengths}, [2.0, 0.5])
    scores = rewards(["p", "p"], ["ab", "c"], [[5, 2], [6]], {"answer": ["x", "x"]}, RewardState(3))
    assert set(seen) >= {"prompts", "completions", "completion_ids", "answer", "trainer_state"}
    assert seen["trainer_state"].global_step == 3
    assert scores[0].tolist() == [1.0, 2.0] and scores[1, 0].isnan()
    advantages = advantages_of(scores, rewards.weights, 2, "group")
    assert advantages.rewards.tolist() == [3.0, 0.5]  # NaN left out of the weighted sum


def test_a_failing_reward_function_is_named_in_one_line() -> None:
    def broken(**kwargs: Any) -> list[float]:
        raise ZeroDivisionError("division by zero\nmore")

    def short(**kwargs: Any) -> list[float]:
        return [1.0]

    for name, function, message in [
        ("broken", broken, "The reward function broken raised ZeroDivisionError: division by zero"),
        ("short", short, "The reward function short returned 1 scores for 2 completions"),
    ]:
        with pytest.raises(RewardFunctionError) as info:
            RewardFunctions.of({name: function})(
                ["p"] * 2, ["a", "b"], [[1], [2]], {}, RewardState(0)
            )
        assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_advantages_of_each_scaling() -> None:
    scores = torch.tensor([[1.0], [3.0], [2.0], [2.0]])
    weights = torch.ones(1)
    group = advantages_of(scores, weights, 2, "group")
    std = torch.tensor([1.0, 3.0]).std()
    torch.testing.assert_close(group.advantages, torch.tensor([-1, 1, 0, 0]) / (std + 1e-4))
    assert group.is_std_zero.tolist() == [False, False, True, True]
    batch = advantages_of(scores, weights, 2, "batch")
    batch_std = scores.flatten().std()
    torch.testing.assert_close(batch.advantages, torch.tensor([-1.0, 1, 0, 0]) / (batch_std + 1e-4))
    assert not batch.is_std_zero.any()
    none = advantages_of(scores, weights, 2, "none")
    assert none.advantages.tolist() == [-1.0, 1.0, 0.0, 0.0]
    # A completion no function scored gets advantage 0 and stays out of its group's mean.
    unscored = advantages_of(torch.tensor([[1.0], [float("nan")], [3.0]]), weights, 3, "none")
    assert unscored.advantages.tolist() == [-1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("loss_type", "expected_sum", "expected_count"),
    [
        ("grpo", 3.0 / 2 + 4.0 / 1, 2),
        ("bnpo", 7.0 / 3, 1),
        ("dr_grpo", 7.0, 2 * 8),
        ("dapo", 7.0, 3),
    ],
)
def test_each_loss_type_returns_a_sum_and_its_count(
    loss_type: Any, expected_sum: float, expected_count: int
) -> None:
    losses = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    total, count = reduce_token_losses(losses, mask, loss_type, max_completion_length=8)
    assert total.item() == pytest.approx(expected_sum) and count == expected_count
