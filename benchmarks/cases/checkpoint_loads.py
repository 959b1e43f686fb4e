"""The loads of the checkpoint case's state on the project's two ways through DCP, taking turns
in one process: what the fast path buys, measured where the host's noise hits both alike."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings
from benchmarks.cases.checkpoint import NUM_BLOCKS, model_dim, num_params
from benchmarks.runner import Comparison, Contender, Metric

KEY = "checkpoint-loads"
LOADS = "this project, fast and public path taking turns"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    dim = model_dim(settings.checkpoint_params_millions)
    size_gb = num_params(dim) * 4 * 3 / 1e9
    rounds = 2 if settings.quick else 6
    return [
        Comparison(
            key=f"{KEY}-{nproc}",
            title=f"loads of the checkpoint case's state (width {dim}, {NUM_BLOCKS} blocks, "
            f"{size_gb:.2f} GB), fast and public path taking turns, {nproc} "
            f"rank{'s' if nproc > 1 else ''}",
            baseline=LOADS,
            metrics=(
                Metric("fast_load_s", "fast, page cache", "s", ratio=False),
                Metric("public_load_s", "public, page cache", "s", ratio=False),
                Metric(
                    "public_over_fast_load_s", "public / fast, page cache", "ratio", ratio=False
                ),
                Metric("fast_load_cold_s", "fast, evicted", "s", ratio=False),
                Metric("public_load_cold_s", "public, evicted", "s", ratio=False),
                Metric(
                    "public_over_fast_load_cold_s", "public / fast, evicted", "ratio", ratio=False
                ),
            ),
            contenders=(
                Contender(
                    name=LOADS,
                    module="benchmarks.checkpoint_worker",
                    args=(
                        *("--tool", "project-loads", "--rounds", str(rounds)),
                        *("--params-millions", str(settings.checkpoint_params_millions)),
                    ),
                    nproc=nproc,
                ),
            ),
            notes=(
                f"One save, then {rounds} rounds of loads in one process, the paths taking turns "
                "(fast, public, public, fast, ...): each path's checkpoint files evicted from "
                "the page cache (posix_fadvise DONTNEED), loaded, then loaded again from the "
                "page cache. Each figure is the median over the rounds of a process (for the "
                "ratio, of each round's pair); the table gives the median of the processes.",
            ),
        )
        for nproc in (1, 2)
    ]
