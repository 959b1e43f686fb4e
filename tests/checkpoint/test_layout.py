"""The world layout a checkpoint records, and what a resume under another one says."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from torch import nn

from checkpoint import WorldLayout
from checkpoint.layout import needs_reshard
from gangs import Gangs


def layout(dp_shard_size: int | None) -> WorldLayout:
    return WorldLayout(world_size=4, dp_size=4, tp_size=1, dp_shard_size=dp_shard_size)


def test_a_plain_model_is_replicated_and_the_manifest_entry_round_trips() -> None:
    now = WorldLayout.of(Gangs.single(), nn.Linear(2, 2))
    assert now.dp_shard_size == 1
    assert WorldLayout.of_manifest(now.as_dict()) == now
    # A manifest written before the entry existed: unknown, not replicated.
    assert (
        WorldLayout.of_manifest({"world_size": 1, "dp_size": 1, "tp_size": 1}).dp_shard_size is None
    )


@pytest.mark.parametrize(
    ("saved", "now", "warning"),
    [
        (
            1,
            2,
            "saved with parameters replicated over the DP ranks; this run has parameters "
            "sharded over 2 DP ranks and replicated 2 times (HSDP). It resumes, but the gradients "
            "are reduced in another order",
        ),
        (
            4,
            2,
            "saved with parameters sharded over all 4 DP ranks (FSDP2); this run has "
            "parameters sharded over 2 DP ranks",
        ),
        (2, 2, None),
        (None, 4, None),
    ],
)
def test_a_resume_under_other_data_parallelism_loads_and_says_it_is_not_bit_identical(
    saved: int | None, now: int, warning: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        resharded = needs_reshard(
            layout(saved), layout(now), step_dir=Path("/run/step_8"), step_nr=8, reshard=False
        )
    assert not resharded
    if warning is None:
        assert not caplog.records
    else:
        assert f"The checkpoint of step 8 was {warning}" in caplog.text
