"""A mixture of experts through ``recipes.lm`` on 2 ranks, with and without expert parallelism."""

from __future__ import annotations

import importlib.util

from benchmarks.cases.base import STEP_TIME, SuiteSettings
from benchmarks.runner import Comparison, Contender

KEY = "moe"
MODULE = "benchmarks.moe_worker"
WHOLE = "DDP, every expert on both ranks"
SPLIT = "DDP, gang.ep_size=2 (4 experts a rank)"


def _contender(name: str, ep_size: int, settings: SuiteSettings) -> Contender:
    missing = importlib.util.find_spec("transformers") is None
    return Contender(
        name=name,
        module=MODULE,
        args=("--ep-size", str(ep_size), *(("--quick",) if settings.quick else ())),
        nproc=2,
        skip_reason="transformers is not installed (pip install -e '.[hf]')" if missing else None,
    )


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        Comparison(
            key=KEY,
            title="Qwen3-MoE, 2 layers of 128, 8 experts (top-2), 4 x 256 tokens a rank, 2 ranks",
            baseline=WHOLE,
            metrics=(STEP_TIME,),
            contenders=(_contender(WHOLE, 1, settings), _contender(SPLIT, 2, settings)),
            notes=(
                "EP pays 3 all-to-alls in each MoE layer's forward and 2 in its backward, and "
                "one host sync a layer's forward (the split sizes): 2 a step here.",
            ),
        )
    ]
