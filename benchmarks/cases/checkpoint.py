"""Checkpoint save, load and async-save blocking time against plain DCP, at 1 and 2 ranks: this
project on each of its two ways through DCP (see docs/checkpoints.md)."""

from __future__ import annotations

from benchmarks.cases.base import SuiteSettings
from benchmarks.runner import Comparison, Contender, Metric

KEY = "checkpoint"
PLAIN_DCP = "plain DCP"
NUM_BLOCKS = 12
"""Blocks of the benchmark's model (see ``benchmarks.checkpoint_worker.make_model``)."""
VOCAB_PER_DIM = 32
FFN_PER_DIM = 3
METRICS = (
    Metric("save_s", "save", "s"),
    Metric("load_s", "load, from the page cache", "s"),
    Metric("load_cold_s", "load, its files evicted from the page cache", "s"),
    Metric("async_blocked_s", "async save, caller blocked", "s"),
    Metric("async_blocked_later_s", "a later async save, caller blocked", "s"),
    Metric("save_gb_per_s", "save", "GB/s"),
    Metric("load_gb_per_s", "load, from the page cache", "GB/s"),
    Metric("load_cold_gb_per_s", "load, evicted", "GB/s"),
)
CONTENDERS = (
    (PLAIN_DCP, ("--tool", "dcp")),
    ("this project, fast path", ("--tool", "project", "--checkpoint-io", "fast")),
    ("this project, public path", ("--tool", "project", "--checkpoint-io", "public")),
)


def model_dim(params_millions: float) -> int:
    """The width (a multiple of 32) whose model has about ``params_millions`` parameters."""
    per_dim_squared = NUM_BLOCKS * (4 + 3 * FFN_PER_DIM) + 2 * VOCAB_PER_DIM
    return max(32, round((params_millions * 1e6 / per_dim_squared) ** 0.5 / 32) * 32)


def num_params(dim: int) -> int:
    block = (4 + 3 * FFN_PER_DIM) * dim * dim + 2 * dim
    return NUM_BLOCKS * block + 2 * VOCAB_PER_DIM * dim * dim + dim


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    dim = model_dim(settings.checkpoint_params_millions)
    params = num_params(dim)
    # Parameters, and two AdamW moments of the same size, in float32.
    size_gb = params * 4 * 3 / 1e9
    return [
        Comparison(
            key=f"{KEY}-{nproc}",
            title=f"checkpoint of a {params / 1e6:.0f}M-parameter transformer shape (width "
            f"{dim}, {NUM_BLOCKS} blocks) with AdamW state ({size_gb:.2f} GB), {nproc} "
            f"rank{'s' if nproc > 1 else ''}",
            baseline=PLAIN_DCP,
            metrics=METRICS,
            contenders=tuple(
                Contender(
                    name=name,
                    module="benchmarks.checkpoint_worker",
                    args=(*args, "--params-millions", str(settings.checkpoint_params_millions)),
                    nproc=nproc,
                )
                for name, args in CONTENDERS
            ),
            notes=(
                "Blocked time of an async save: the call, plus waiting for the save (and its "
                "commit) at the next checkpoint, after the write had time to finish. The first "
                "async save of the process, and the one after it.",
                "A load right after the save reads its files from the page cache; the evicted "
                "load reads them again after each rank dropped its files from the page cache "
                "(posix_fadvise DONTNEED). GB/s: the state's bytes on rank 0 over the time.",
            ),
        )
        for nproc in (1, 2)
    ]
