"""What the recipes share: the config sections every recipe has (:mod:`recipes.common.sections`),
and how they become a Trainer (:mod:`recipes.common.assembly`). A recipe owns its model and data;
the gang, optimizer, FSDP2 and trainer sections, the learning rate schedule and the Trainer's
keyword arguments are the same for all of them."""

from __future__ import annotations

from recipes.common.assembly import (
    BuildConfig,
    ParallelConfig,
    ParallelOptions,
    PipelineSplit,
    adamw_with_schedule,
    data_parallel_kind,
    dtype_of,
    parallel_options,
    precision_options,
    setup_recipe_gangs,
    shards_parameters,
    trainer_options,
    warmup_cosine,
)
from recipes.common.sections import (
    FsdpSection,
    GangSection,
    LossSpikeSection,
    OptimizerSection,
    PipelineSection,
    TrainerSection,
)

__all__ = [
    "BuildConfig",
    "FsdpSection",
    "GangSection",
    "LossSpikeSection",
    "OptimizerSection",
    "ParallelConfig",
    "ParallelOptions",
    "PipelineSection",
    "PipelineSplit",
    "TrainerSection",
    "adamw_with_schedule",
    "data_parallel_kind",
    "dtype_of",
    "parallel_options",
    "precision_options",
    "setup_recipe_gangs",
    "shards_parameters",
    "trainer_options",
    "warmup_cosine",
]
