"""Issue 9's figures: meta-device build memory, activation-checkpointing memory, compiled steps.

Each is a comparison of two contenders of :mod:`benchmarks.large_model_worker`; the case is
skipped (its contenders say why) where the recipe lacks the switch it measures.
"""

from __future__ import annotations

import dataclasses

from benchmarks.cases.base import SuiteSettings
from benchmarks.runner import Comparison, Contender, Metric

KEY = "large"
RSS_GROWTH = Metric("rss_growth_bytes", "peak RSS growth", "bytes")


def _missing(field: str, section: str) -> str | None:
    from recipes import char_lm

    names = {f.name for f in dataclasses.fields(getattr(char_lm, section))}
    return None if field in names else f"the char-LM recipe has no {field} switch"


def _pair(
    mode: str, names: tuple[str, str], settings: SuiteSettings, *, nproc: int, skip: str | None
) -> tuple[Contender, ...]:
    quick = ("--quick",) if settings.quick else ()
    return tuple(
        Contender(
            name=name,
            module="benchmarks.large_model_worker",
            args=(mode, "--on", str(on), *quick),
            nproc=nproc,
            skip_reason=skip,
        )
        for on, name in enumerate(names)
    )


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    return [
        Comparison(
            key="meta-init",
            title="building the char-LM, dim 1024 (512 with --quick), 8 layers, under FSDP2, "
            "2 ranks (rank 0)",
            baseline="whole",
            metrics=(RSS_GROWTH,),
            contenders=_pair(
                "build",
                ("whole", "on meta"),
                settings,
                nproc=2,
                skip=_missing("meta_init", "ModelSection"),
            ),
        ),
        Comparison(
            key="activation-checkpointing",
            title="forward and backward of 4 x 2048 bytes, dim 256, 4 layers, 1 process",
            baseline="without",
            metrics=(RSS_GROWTH,),
            contenders=_pair(
                "ac",
                ("without", "every block"),
                settings,
                nproc=1,
                skip=_missing("activation_checkpointing", "ModelSection"),
            ),
        ),
        Comparison(
            key="compile",
            title="W2 model, compiled block by block with the loss, 1 process",
            baseline="eager",
            metrics=(
                Metric("step_time_s", "step time", "s"),
                Metric("first_step_s", "first step (holds the compilation)", "s"),
            ),
            contenders=_pair(
                "compile",
                ("eager", "compiled"),
                settings,
                nproc=1,
                skip=_missing("compile", "CharLMConfig"),
            ),
        ),
    ]
