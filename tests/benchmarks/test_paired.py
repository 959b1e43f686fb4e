from __future__ import annotations

import itertools

import pytest

from benchmarks.paired_worker import block_figures


def test_each_trainer_block_is_compared_with_the_hand_written_blocks_around_it() -> None:
    # A host that slows down steadily: the hand-written blocks take 1, 2, 3, 4 ms a step, and
    # each Trainer block, run between two of them, 5% more than their mean.
    hand = [1e-3, 2e-3, 3e-3, 4e-3]
    trainer = [1.05 * (a + b) / 2 for a, b in itertools.pairwise(hand)]
    figures = block_figures(trainer, hand, skip=0)
    assert figures["ratio"] == pytest.approx(1.05)
    assert figures["trainer_step_s"] == pytest.approx(1.05 * 2.5e-3)
    assert figures["hand_step_s"] == pytest.approx(2.5e-3)
    assert figures["extra_s"] == pytest.approx(0.05 * 2.5e-3)


def test_the_warm_up_blocks_are_left_out() -> None:
    hand = [1e-3] * 5
    figures = block_figures([9e-3, 1.1e-3, 1.1e-3, 1.2e-3], hand, skip=1)
    assert figures["ratio"] == pytest.approx(1.1)


def test_too_few_blocks_is_an_error_that_says_so() -> None:
    with pytest.raises(ValueError, match="2 Trainer blocks make no pair after the 2 of warm-up"):
        block_figures([1e-3, 1e-3], [1e-3, 1e-3, 1e-3], skip=2)
