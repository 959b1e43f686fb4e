"""IndexPermutation: a bijection of [0, n) drawn from a seed, one index at a time."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.data.permutation import IndexPermutation


@pytest.mark.parametrize("size", [1, 2, 3, 5, 17, 1000, 4097, 65_537])
def test_every_position_is_hit_exactly_once(size: int) -> None:
    order = IndexPermutation(size, seed=7)(np.arange(size))
    assert sorted(order.tolist()) == list(range(size))


def test_the_seed_alone_decides_the_order_and_any_index_maps_on_its_own() -> None:
    whole = IndexPermutation(10_000, seed=1)(np.arange(10_000))
    assert whole.tolist() == IndexPermutation(10_000, seed=1)(np.arange(10_000)).tolist()
    assert whole.tolist() != IndexPermutation(10_000, seed=2)(np.arange(10_000)).tolist()
    picked = np.array([9_999, 3, 5_000, 3])
    assert IndexPermutation(10_000, seed=1)(picked).tolist() == whole[picked].tolist()


def test_the_order_is_shuffled_not_shifted() -> None:
    order = IndexPermutation(100_000, seed=3)(np.arange(100_000))
    # Neighbours land far apart, and each tenth of the positions spreads over the whole range.
    assert np.median(np.abs(np.diff(order))) > 10_000
    for tenth in np.split(order, 10):
        assert np.histogram(tenth, bins=10, range=(0, 100_000))[0].min() > 800
    assert abs(np.corrcoef(np.arange(100_000), order)[0, 1]) < 0.02


def test_bad_sizes_and_indices_are_refused() -> None:
    with pytest.raises(ValueError, match="size must be greater than zero, but is 0"):
        IndexPermutation(0, seed=0)
    with pytest.raises(IndexError, match="out of range"):
        IndexPermutation(10, seed=0)(np.array([10]))
