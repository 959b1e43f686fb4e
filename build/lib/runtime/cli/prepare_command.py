"""``python -m runtime prepare``: tokenize text files once into a prepared dataset."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.data.text import PreparedDataset, load_tokenizer, prepare_dataset


def add_prepare_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prepare = commands.add_parser(
        "prepare",
        help="tokenize .jsonl, .txt and .parquet files once into a prepared dataset",
        description="Tokenize the INPUT files (files, directories or globs) with N worker "
        "processes into OUTPUT_DIR: token files, a document index and a manifest. Run the same "
        "command again after a kill or a full disk and it goes on from the finished chunks.",
    )
    prepare.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT")
    prepare.add_argument(
        "--tokenizer",
        required=True,
        help="a Hugging Face tokenizer.json or its directory; 'bytes' for UTF-8 bytes",
    )
    prepare.add_argument("--text-field", default="text", help="the JSONL field or Parquet column")
    prepare.add_argument(
        "--skip-bad-lines", action="store_true", help="skip and count bad lines instead of stopping"
    )
    prepare.add_argument("--no-bos", action="store_true", help="put no BOS before each document")
    prepare.add_argument(
        "--num-workers", type=int, default=None, help="tokenizing processes (default: one a core)"
    )
    prepare.add_argument(
        "--chunk-mb", type=float, default=8.0, help="MiB of text a worker tokenizes at a time"
    )
    verify = commands.add_parser(
        "verify-data",
        help="check a prepared dataset's files against its manifest, byte for byte",
    )
    verify.add_argument("output_dir", type=Path, metavar="DATA_DIR")


def run_verify(args: argparse.Namespace) -> None:
    dataset = PreparedDataset(args.output_dir)
    dataset.verify()
    print(
        f"{args.output_dir}: {dataset.num_documents:,} documents, {dataset.num_tokens:,} tokens; "
        "every file matches the manifest."
    )


def run_prepare(args: argparse.Namespace) -> None:
    """Raises ValueError for bad arguments or data, OSError when a file cannot be written."""
    prepare_dataset(
        args.output_dir,
        args.inputs,
        tokenizer=load_tokenizer(None if args.tokenizer == "bytes" else args.tokenizer),
        text_field=args.text_field,
        skip_bad_lines=args.skip_bad_lines,
        add_bos=not args.no_bos,
        num_workers=args.num_workers,
        chunk_bytes=max(1, int(args.chunk_mb * 2**20)),
        report=lambda line: print(line, file=sys.stderr, flush=True),
    )
