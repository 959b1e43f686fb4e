"""Text data files: finding them, cutting them into chunks, and reading a chunk into tokens.

A file's documents have *offsets*: the byte where a line starts in JSONL (``.jsonl``) and plain
text (``.txt``, one document a line, as Hugging Face ``datasets`` reads text), the row number in
Parquet (``.parquet``). A chunk ``[start, end)`` holds the documents whose offset lies in it, so
chunks are fixed by the file's size alone, and a reader can start at any document's offset.
:func:`read_chunk` runs in worker processes: it must stay picklable and use no torch.
"""

from __future__ import annotations

import glob
import json
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, final

from runtime.data.text.tokenizer import Tokenizer

FORMATS = {".jsonl": "jsonl", ".txt": "text", ".parquet": "parquet"}


class TextDataError(ValueError):
    """A data file that cannot be read, or a document in it that is not what the reader needs."""


@final
@dataclass(frozen=True)
class DataFile:
    path: str
    format: str

    @staticmethod
    def of(path: str) -> DataFile:
        suffix = Path(path).suffix.lower()
        if suffix not in FORMATS:
            raise TextDataError(
                f"{path} has the extension {suffix!r}, which is not a text data format. Use "
                f"{', '.join(FORMATS)} files."
            )
        return DataFile(path, FORMATS[suffix])


def find_files(pattern: str | Path) -> list[DataFile]:
    """The data files of a path, a directory (its files of known formats) or a glob, sorted."""
    text = str(pattern)
    if any(char in text for char in "*?["):
        paths = sorted(glob.glob(text, recursive=True))
    elif os.path.isdir(text):
        paths = sorted(
            str(path) for path in Path(text).rglob("*") if path.suffix.lower() in FORMATS
        )
    elif os.path.exists(text):
        paths = [text]
    else:
        raise TextDataError(f"The data path {text} does not exist. Give a file, directory or glob.")
    files = [DataFile.of(path) for path in paths if os.path.isfile(path)]
    if not files:
        raise TextDataError(
            f"The data path {text} matches no data file. Give .jsonl, .txt or .parquet files, "
            "a directory holding them, or a glob such as 'data/*.jsonl'."
        )
    return files


@final
@dataclass(frozen=True)
class ReadOptions:
    """How documents become tokens; sent once to each worker process."""

    tokenizer: Tokenizer
    text_field: str = "text"
    skip_bad_lines: bool = False
    add_bos: bool = True
    chunk_bytes: int = 1 << 20
    chunk_rows: int = 1024


@final
@dataclass
class ChunkTokens:
    """The documents of a chunk: their offsets, and their tokens (BOS, text, EOS) one after another."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # the offset after each document
    lengths: list[int] = field(default_factory=list)
    tokens: bytes = b""  # int32 ids, in native byte order
    num_bad_lines: int = 0
    first_bad_line: str | None = None


def chunk_ends(file: DataFile, options: ReadOptions) -> list[int]:
    """The end offsets of the file's chunks, in order; the first chunk starts at offset 0."""
    try:
        if file.format == "parquet":
            import pyarrow.parquet as pq

            metadata = pq.ParquetFile(file.path).metadata
            ends: list[int] = []
            total = 0
            for group in range(metadata.num_row_groups):
                rows = metadata.row_group(group).num_rows
                ends.extend(range(total + options.chunk_rows, total + rows, options.chunk_rows))
                total += rows
                ends.append(total)
            return [end for end in ends if end > 0]
        size = os.path.getsize(file.path)
    except Exception as ex:
        raise TextDataError(f"Cannot read the data file {file.path}: {ex}") from ex
    return [*range(options.chunk_bytes, size, options.chunk_bytes), size] if size else []


def read_chunk(file: DataFile, start: int, end: int, options: ReadOptions) -> ChunkTokens:
    """Tokenize the documents of ``file`` whose offsets lie in ``[start, end)``."""
    chunk = ChunkTokens()
    texts: list[str] = []
    try:
        documents = _parquet_rows if file.format == "parquet" else _lines
        for offset, next_offset, text, problem in documents(file, start, end, options):
            if problem is not None:
                where = _where(file, offset)
                message = f"{where}: {problem}"
                if not options.skip_bad_lines:
                    raise TextDataError(
                        f"{message}. Fix the data, or set skip_bad_lines to skip and count such "
                        "lines."
                    )
                chunk.num_bad_lines += 1
                chunk.first_bad_line = chunk.first_bad_line or message
            elif text:
                chunk.starts.append(offset)
                chunk.ends.append(next_offset)
                texts.append(text)
    except OSError as ex:
        raise TextDataError(f"Cannot read the data file {file.path}: {ex}") from ex
    tokenizer = options.tokenizer
    bos = [tokenizer.bos_id] if options.add_bos and tokenizer.bos_id is not None else []
    tokens = array("i")
    for ids in tokenizer.encode_batch(texts) if texts else []:
        document = bos + ids + [tokenizer.eos_id]
        chunk.lengths.append(len(document))
        tokens.extend(document)
    chunk.tokens = tokens.tobytes()
    return chunk


# A document as the readers give it: offset, next offset, text, and what is wrong with it.
_Document = tuple[int, int, str, str | None]


def _lines(file: DataFile, start: int, end: int, options: ReadOptions) -> Iterator[_Document]:
    with open(file.path, "rb") as stream:
        # A chunk holds the lines that start in it: skip one that began before ``start``.
        if start > 0:
            stream.seek(start - 1)
            if stream.read(1) != b"\n":
                stream.readline()
        offset = stream.tell()
        while offset < end:
            line = stream.readline()
            if not line:
                return
            next_offset = offset + len(line)
            yield offset, next_offset, *_parse_line(line, file.format, options.text_field)
            offset = next_offset


def _parse_line(line: bytes, file_format: str, text_field: str) -> tuple[str, str | None]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as ex:
        return "", f"the line is not UTF-8 ({ex})"
    if file_format == "text":
        return text.rstrip("\r\n"), None
    if not text.strip():
        return "", None
    try:
        record = json.loads(text)
    except ValueError as ex:
        return "", f"the line is not JSON ({ex})"
    return _text_of(record, text_field)


def _text_of(record: Any, text_field: str) -> tuple[str, str | None]:
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        return "", f"the record has no field {text_field!r} (it has {keys}); set text_field"
    value = record[text_field]
    if not isinstance(value, str):
        return "", f"the field {text_field!r} is {type(value).__name__}, not a string"
    return value, None


def _parquet_rows(
    file: DataFile, start: int, end: int, options: ReadOptions
) -> Iterator[_Document]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file.path)
    if options.text_field not in parquet.schema_arrow.names:
        raise TextDataError(
            f"{file.path} has no column {options.text_field!r} (it has "
            f"{parquet.schema_arrow.names}). Set text_field to the column of the text."
        )
    first_row = 0
    for group in range(parquet.metadata.num_row_groups):
        num_rows = parquet.metadata.row_group(group).num_rows
        if first_row < end and start < first_row + num_rows:
            column = parquet.read_row_group(group, columns=[options.text_field]).column(0)
            low, high = max(start - first_row, 0), min(end - first_row, num_rows)
            for row, value in enumerate(column.slice(low, high - low).to_pylist(), low):
                offset = first_row + row
                yield offset, offset + 1, *_text_of({options.text_field: value}, options.text_field)
        first_row += num_rows


def _where(file: DataFile, offset: int) -> str:
    """``path:line N`` (or ``path:row N``) of the document at ``offset``; counts lines anew."""
    if file.format == "parquet":
        return f"{file.path}: row {offset + 1}"
    with open(file.path, "rb") as stream:
        line_nr = stream.read(offset).count(b"\n") + 1
    return f"{file.path}: line {line_nr}"


def describe(files: Sequence[DataFile]) -> str:
    names = [file.path for file in files[:3]]
    return ", ".join(names) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
