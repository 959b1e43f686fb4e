"""Text data: the tokens a second one rank gets by DP size, from the reader that tokenizes on the
fly and from a prepared dataset; preparing against the tokenizer alone; opening by corpus size."""

from __future__ import annotations

from benchmarks.cases.base import PEAK_RSS, SuiteSettings
from benchmarks.runner import Comparison, Contender, Metric

KEY = "text-data"

TOKENS_PER_S = Metric("tokens_per_s", "tokens/s", "count")
_WORKER = "benchmarks.text_data_worker"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    corpus = ("--corpus-mb", "20" if settings.quick else "200")
    return [_deliver(settings, corpus), _prepare(corpus), _open(settings)]


def _deliver(settings: SuiteSettings, corpus: tuple[str, str]) -> Comparison:
    options = (
        *corpus,
        *("--text-gb", "0.1" if settings.quick else "5"),
        *("--seconds", "2" if settings.quick else "10"),
    )
    dp_sizes = (1, 8) if settings.quick else (1, 8, 64, 512)
    return Comparison(
        key=f"{KEY}-deliver",
        title="tokens a second delivered to one rank, seq_len 1024, batch 8, BPE of 4,096 ids",
        baseline="prepared, DP=1",
        metrics=(TOKENS_PER_S,),
        contenders=tuple(
            Contender(
                name=f"{reader}, DP={dp}",
                module=_WORKER,
                args=("deliver", "--reader", reader, "--dp", str(dp), *options),
            )
            for reader in ("prepared", "text")
            for dp in dp_sizes
        ),
        notes=(
            "One process stands in for rank 0 of a gang of DP ranks (neither reader makes "
            "a collective after its first check). The on-the-fly reader tokenizes every "
            "rank's sequences of the corpus and keeps its own; the prepared one reads only "
            "its own, from random ids in the amount 5 GB of text makes, so that one of 512 "
            "ranks has an epoch of 300 steps (the corpus would give it 7).",
        ),
    )


def _prepare(corpus: tuple[str, str]) -> Comparison:
    return Comparison(
        key=f"{KEY}-prepare",
        title="preparing the corpus against the tokenizer's own encode_batch, all cores",
        baseline="encode_batch",
        metrics=(TOKENS_PER_S,),
        contenders=(
            Contender(name="encode_batch", module=_WORKER, args=("encode", *corpus)),
            Contender(name="python -m runtime prepare", module=_WORKER, args=("prepare", *corpus)),
        ),
        notes=(
            "encode_batch tokenizes texts already in memory in batches of 1,000; preparing "
            "also reads and parses the JSONL and writes the token files.",
        ),
    )


def _open(settings: SuiteSettings) -> Comparison:
    sizes_gb = (0.1,) if settings.quick else (0.1, 1.0, 5.0)
    return Comparison(
        key=f"{KEY}-open",
        title="opening a prepared dataset and reading its first step, by corpus size",
        baseline=f"{sizes_gb[0]:g} GB of text",
        metrics=(Metric("startup_s", "start-up", "s"), PEAK_RSS),
        contenders=tuple(
            Contender(
                name=f"{gb:g} GB of text", module=_WORKER, args=("open", "--text-gb", str(gb))
            )
            for gb in sizes_gb
        ),
        notes=(
            "Random token ids in the amount such text makes (4 bytes a token), so the sizes "
            "need no tokenizing; opening reads the manifest and maps the files.",
        ),
    )
