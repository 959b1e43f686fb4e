"""One process of the text-data case: what a data reader delivers to one rank, what preparing
costs against the tokenizer alone, and what opening a prepared dataset costs by its size.

``python -m benchmarks.text_data_worker MODE [options]``, with MODE one of:

- ``deliver --reader text|prepared --dp N``: tokens a second that rank 0 of an ``N``-rank
  data-parallel gang gets. One process stands in for rank 0: both readers make no collective
  after their first check, so a gang that says it has ``N`` ranks gives that rank's figure.
  The text reader reads the corpus; the prepared one the random ids of ``--text-gb``.
- ``encode``: the tokenizer's own ``encode_batch`` over the corpus's texts, held in memory.
- ``prepare``: ``prepare_dataset`` of the corpus's files with one worker a core.
- ``open --text-gb G``: opening a prepared dataset as large as ``G`` GB of text would make and
  reading its first step (made here from random tokens: opening reads no token).

The corpus (JSONL of Zipf-distributed words) and a BPE tokenizer of 4,096 ids trained on it are
made once under ``--cache`` and reused. Prints ``BENCH_RESULT {...}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.probe import emit
from benchmarks.stand_in_gang import RankGang

SEQ_LEN = 1024
BATCH_SIZE = 8
VOCAB_SIZE = 4096


def make_corpus(cache: Path, megabytes: int) -> tuple[Path, Path]:
    """The corpus's JSONL file and tokenizer directory, made on first use."""
    corpus = cache / f"corpus_{megabytes}mb.jsonl"
    tokenizer_dir = cache / "tokenizer"
    if not corpus.exists():
        cache.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        words = [f"w{i}" + "abcdefgh"[: 1 + i % 7] for i in range(20_000)]
        partial = corpus.with_suffix(".partial")
        with open(partial, "w") as out:
            while out.tell() < megabytes * 1_000_000:
                ids = rng.zipf(1.2, size=(256, 200)) % len(words)
                for row in ids:
                    out.write(json.dumps({"text": " ".join(words[i] for i in row)}) + "\n")
        partial.replace(corpus)
    if not tokenizer_dir.exists():
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"]
        )
        with open(corpus) as lines:
            tokenizer.train_from_iterator(
                (json.loads(line)["text"] for line in itertools.islice(lines, 20_000)), trainer
            )
        tokenizer_dir.mkdir()
        tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
        (tokenizer_dir / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
        )
    return corpus, tokenizer_dir


def prepared_corpus(cache: Path, megabytes: int) -> Path:
    from runtime.data.text import load_tokenizer, prepare_dataset

    corpus, tokenizer_dir = make_corpus(cache, megabytes)
    out = cache / f"prepared_{megabytes}mb"
    prepare_dataset(out, [corpus], tokenizer=load_tokenizer(tokenizer_dir))
    return out


def deliver(args: argparse.Namespace) -> dict[str, float]:
    from runtime.data.text import PreparedDataReader, TextDataReader, load_tokenizer

    corpus, tokenizer_dir = make_corpus(args.cache, args.corpus_mb)
    gang = RankGang(rank=0, size=args.dp)
    options: dict[str, Any] = {"seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, "gang": gang}
    if args.reader == "text":
        reader: Any = TextDataReader(
            sources=str(corpus), tokenizer=load_tokenizer(tokenizer_dir), **options
        )
    else:
        # Random ids of --text-gb of text (5 GB: an epoch of 300 steps for one of 512 ranks,
        # where the corpus would give 7, each paying the epoch's start; see the case's notes).
        reader = PreparedDataReader(
            sources=random_dataset(args.cache, args.text_gb), num_prefetch=0, **options
        )
    next(reader)  # the first check and the epoch's permutation
    tokens, start = 0, time.perf_counter()
    # At least one step: the text reader at DP=512 takes longer than the window for one.
    while tokens == 0 or time.perf_counter() - start < args.seconds:
        try:
            batches = next(reader)
        except StopIteration:
            reader.reset()
            continue
        tokens += sum(batch.num_targets for batch in batches)
    reader.close()
    return {"tokens_per_s": tokens / (time.perf_counter() - start)}


def _texts(corpus: Path) -> list[str]:
    with open(corpus) as lines:
        return [json.loads(line)["text"] for line in lines]


def encode(args: argparse.Namespace) -> dict[str, float]:
    from runtime.data.text import load_tokenizer

    corpus, tokenizer_dir = make_corpus(args.cache, args.corpus_mb)
    tokenizer = load_tokenizer(tokenizer_dir)
    texts = _texts(corpus)
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(texts), 1000):
        tokens += sum(len(ids) + 2 for ids in tokenizer.encode_batch(texts[first : first + 1000]))
    return {"tokens_per_s": tokens / (time.perf_counter() - start)}


def prepare(args: argparse.Namespace) -> dict[str, float]:
    from runtime.data.text import load_tokenizer, prepare_dataset

    corpus, tokenizer_dir = make_corpus(args.cache, args.corpus_mb)
    with tempfile.TemporaryDirectory(dir=args.cache) as scratch:
        start = time.perf_counter()
        dataset = prepare_dataset(
            Path(scratch) / "out", [corpus], tokenizer=load_tokenizer(tokenizer_dir)
        )
        elapsed = time.perf_counter() - start
        return {"tokens_per_s": dataset.num_tokens / elapsed, "seconds": elapsed}


def open_dataset(args: argparse.Namespace) -> dict[str, float]:
    from runtime.data.text import PreparedDataReader

    directory = random_dataset(args.cache, args.text_gb)
    start = time.perf_counter()
    reader = PreparedDataReader(
        sources=directory,
        seq_len=SEQ_LEN,
        batch_size=BATCH_SIZE,
        gang=RankGang(rank=0, size=1),
        num_prefetch=0,
    )
    next(reader)
    return {"startup_s": time.perf_counter() - start, "num_sequences": float(reader.num_sequences)}


def random_dataset(cache: Path, text_gb: float) -> Path:
    """A prepared dataset of the tokens ``text_gb`` GB of English text makes (4 bytes a token),
    random ids in documents of 512 tokens, with a manifest as the writer writes it."""
    from runtime.data.text.prepared import format as prepared

    directory = cache / f"random_{text_gb:g}gb"
    if (directory / prepared.MANIFEST_FILE).exists():
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    num_tokens = int(text_gb * 1e9 / 4)
    rng = np.random.default_rng(0)
    with open(directory / prepared.TOKENS_FILE, "wb") as out:
        for first in range(0, num_tokens, 1 << 26):
            out.write(
                rng.integers(0, VOCAB_SIZE, min(1 << 26, num_tokens - first), dtype="<u2").tobytes()
            )
    ends = np.arange(512, num_tokens + 512, 512, dtype="<i8")
    ends[-1] = num_tokens
    ends.tofile(directory / prepared.DOCUMENTS_FILE)
    files = {
        name: {
            "size": os.path.getsize(directory / name),
            "digest": prepared.file_digest(directory / name),
        }
        for name in (prepared.TOKENS_FILE, prepared.DOCUMENTS_FILE)
    }
    plan = {
        "sources": [],
        "tokenizer": {"fingerprint": "random", "vocab_size": VOCAB_SIZE, "eos_id": 2, "bos_id": 1},
        "text_field": "text",
        "skip_bad_lines": False,
        "add_bos": True,
        "dtype": "uint16",
    }
    prepared.write_manifest(
        directory,
        plan,
        num_tokens=num_tokens,
        num_documents=len(ends),
        num_bad_lines=0,
        files=files,
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text_data_worker")
    parser.add_argument("mode", choices=("deliver", "encode", "prepare", "open"))
    parser.add_argument("--reader", choices=("text", "prepared"), default="prepared")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--corpus-mb", type=int, default=200)
    parser.add_argument("--text-gb", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "trainkit_text_bench"
    )
    args = parser.parse_args()
    modes = {"deliver": deliver, "encode": encode, "prepare": prepare, "open": open_dataset}
    emit(modes[args.mode](args))


if __name__ == "__main__":
    main()
