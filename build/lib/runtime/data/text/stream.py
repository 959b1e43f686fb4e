"""The token stream of one dataset: its documents in order, pass after pass, from a cursor.

A dataset is read in *passes*; each pass visits its files in an order drawn from the seed, the
data epoch, the dataset's number and the pass (or sorted, without shuffling), and each file's
documents in file order. The :class:`Cursor` is the whole position, so a stream started from a
saved cursor gives the same tokens as one that never stopped.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import final

import torch
from torch import Tensor

from runtime.data.text.files import (
    ChunkTokens,
    DataFile,
    ReadOptions,
    TextDataError,
    chunk_ends,
    describe,
)
from runtime.data.text.workers import ChunkReader, ChunkTask

log = logging.getLogger(__name__)


@final
@dataclass
class Cursor:
    """The position in a dataset: the pass, the file in its order, and the next document's offset,
    of which ``token_nr`` tokens were already taken."""

    pass_nr: int = 0
    file_nr: int = 0
    offset: int = 0
    token_nr: int = 0


@final
class DocumentStream:
    """Tokens of one dataset's documents, taken in pieces; reads up to ``depth`` chunks ahead."""

    def __init__(
        self,
        *,
        files: Sequence[DataFile],
        options: ReadOptions,
        seed: str,
        shuffle_files: bool,
        depth: int,
    ) -> None:
        self._files = list(files)
        self._reader: ChunkReader | None = None
        self._options = options
        self._seed = seed
        self._shuffle_files = shuffle_files
        self._depth = depth
        self._chunk_ends: dict[str, list[int]] = {}
        self.num_bad_lines = 0
        self.start(epoch=0, cursor=Cursor())

    @property
    def num_files(self) -> int:
        return len(self._files)

    @property
    def cursor(self) -> Cursor:
        return Cursor(**vars(self._cursor))

    def attach(self, reader: ChunkReader) -> None:
        """Read with ``reader`` from now on, going on from the cursor."""
        self.start(epoch=self._epoch, cursor=self._cursor)
        self._reader = reader

    def start(self, *, epoch: int, cursor: Cursor) -> None:
        """Go to ``cursor`` of data epoch ``epoch``, dropping what was read ahead."""
        if self._reader is not None:
            for _, _, ticket in self._pending:
                self._reader.forget(ticket)
        self._epoch = epoch
        self._cursor = Cursor(**vars(cursor))
        self._from_pass_start = cursor == Cursor(pass_nr=cursor.pass_nr)
        # The chunks read ahead, each with its file's number in the pass: the first is current.
        self._pending: deque[tuple[int, ChunkTask, int]] = deque()
        self._tasks = self._chunks_from(cursor)
        self._chunk: ChunkTokens | None = None
        self._tokens = torch.empty(0, dtype=torch.int32)
        self._doc_nr = 0
        self._doc_start = 0  # of the current document in self._tokens
        self._tokens_in_pass = 0

    def take(self, count: int) -> tuple[list[Tensor], bool]:
        """Up to ``count`` tokens as pieces, one per document; True if the pass ended first.

        After a pass ends, the next call goes on with the next pass.
        """
        pieces: list[Tensor] = []
        cursor = self._cursor
        while count > 0:
            if self._chunk is None or self._doc_nr == len(self._chunk.lengths):
                if not self._next_chunk():
                    return pieces, True
                continue
            length = self._chunk.lengths[self._doc_nr]
            first = self._doc_start + cursor.token_nr
            size = min(count, length - cursor.token_nr)
            pieces.append(self._tokens[first : first + size])
            count -= size
            cursor.token_nr += size
            self._tokens_in_pass += size
            if cursor.token_nr == length:
                cursor.offset = self._chunk.ends[self._doc_nr]
                cursor.token_nr = 0
                self._doc_start += length
                self._doc_nr += 1
                if self._doc_nr < len(self._chunk.lengths):
                    cursor.offset = self._chunk.starts[self._doc_nr]
        return pieces, False

    def _next_chunk(self) -> bool:
        """Move to the next chunk with its documents; False (and the next pass) at a pass end."""
        if self._reader is None:
            raise RuntimeError("The document stream has no chunk reader; attach one first.")
        if self._chunk is not None:
            self._pending.popleft()
        while len(self._pending) < self._depth:
            numbered = next(self._tasks, None)
            if numbered is None:
                break
            file_nr, task = numbered
            self._pending.append((file_nr, task, self._reader.submit(task)))
        if not self._pending:
            self._end_pass()
            return False
        file_nr, (_, start, _), ticket = self._pending[0]
        self._chunk = chunk = self._reader.result(ticket)
        if chunk.num_bad_lines:
            self.num_bad_lines += chunk.num_bad_lines
            log.warning(
                "Skipped %d bad lines; the first: %s", chunk.num_bad_lines, chunk.first_bad_line
            )
        self._tokens = (
            torch.frombuffer(bytearray(chunk.tokens), dtype=torch.int32)
            if chunk.tokens
            else torch.empty(0, dtype=torch.int32)
        )
        self._doc_nr = self._doc_start = 0
        # Documents before the chunk's first (blank or skipped lines) are behind the cursor too.
        self._cursor.file_nr = file_nr
        self._cursor.offset = chunk.starts[0] if chunk.starts else start
        return True

    def _end_pass(self) -> None:
        if self._tokens_in_pass == 0 and self._from_pass_start:
            raise TextDataError(
                f"The dataset {describe(self._files)} has no documents with text. Check the "
                "files and text_field."
            )
        self.start(epoch=self._epoch, cursor=Cursor(pass_nr=self._cursor.pass_nr + 1))

    def _file_order(self) -> list[DataFile]:
        if not self._shuffle_files:
            return self._files
        order = list(self._files)
        random.Random(f"{self._seed}/{self._epoch}/{self._cursor.pass_nr}").shuffle(order)
        return order

    def _chunks_from(self, cursor: Cursor) -> Iterator[tuple[int, ChunkTask]]:
        order = self._file_order()
        for file_nr in range(cursor.file_nr, len(order)):
            file = order[file_nr]
            start = cursor.offset if file_nr == cursor.file_nr else 0
            for end in self._ends_of(file):
                if end > start:
                    yield file_nr, (file, start, end)
                    start = end

    def _ends_of(self, file: DataFile) -> list[int]:
        ends = self._chunk_ends.get(file.path)
        if ends is None:
            ends = self._chunk_ends[file.path] = chunk_ends(file, self._options)
        return ends
