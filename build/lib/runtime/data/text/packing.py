"""Packed batches: sequences of ``seq_len`` inputs and targets cut from a stream of documents."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch
from torch import Tensor


@final
@dataclass
class TextBatch:
    """A micro-batch of packed sequences; every position has a target, so none is padding.

    ``document_ids`` numbers the documents (or their parts) within each sequence from 0, and
    ``positions`` counts each one's tokens from 0, so a model can keep attention inside a
    document and restart its position encoding there; both are None unless asked for.
    """

    input_ids: Tensor  # [batch_size, seq_len], int64
    target_ids: Tensor  # [batch_size, seq_len], int64: input_ids shifted by one
    num_targets: int
    document_ids: Tensor | None = None  # [batch_size, seq_len], int64
    positions: Tensor | None = None  # [batch_size, seq_len], int64
    sequence_ids: Tensor | None = None  # [batch_size], int64
    """Each row's number among the sequences of its data (prepared data only), to see which
    sequences a step read."""
    num_bad_lines: int = 0
    """Lines the reader had skipped (``skip_bad_lines``) when it made this batch, so a unit can
    publish the count."""

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)


def make_batch(rows: Sequence[Sequence[Tensor]], *, with_documents: bool) -> TextBatch:
    """The batch of ``rows``, each the pieces (one per document) of ``seq_len + 1`` tokens."""
    tokens = torch.stack([torch.cat(list(pieces)) for pieces in rows]).long()
    if not with_documents:
        return batch_of(tokens, document_starts=None)
    row_nrs: list[int] = []
    starts: list[int] = []
    for row_nr, pieces in enumerate(rows):
        start = 0
        for piece in pieces[:-1]:
            start += len(piece)
            row_nrs.append(row_nr)
            starts.append(start)
    return batch_of(tokens, document_starts=(row_nrs, starts))


def batch_of(
    tokens: Tensor, *, document_starts: tuple[Sequence[int], Sequence[int]] | None
) -> TextBatch:
    """The batch of ``tokens`` (``[batch_size, seq_len + 1]``, int64); ``document_starts``, the
    row and column of each document that starts after a row's first token, or None for a
    batch without document ids."""
    batch = TextBatch(
        input_ids=tokens[:, :-1].contiguous(),
        target_ids=tokens[:, 1:].contiguous(),
        num_targets=tokens.shape[0] * (tokens.shape[1] - 1),
    )
    if document_starts is not None:
        # One mark where each later document starts: counting the marks numbers the
        # documents, and the last mark at or before a token is where its document started.
        marks = torch.zeros(tokens.shape, dtype=torch.bool)
        row_nrs, columns_of_starts = (torch.as_tensor(v, dtype=torch.long) for v in document_starts)
        marks[row_nrs, columns_of_starts] = True
        columns = torch.arange(tokens.shape[1]).expand(tokens.shape)
        document_starts_of = torch.where(marks, columns, 0).cummax(1).values
        batch.document_ids = marks.long().cumsum(1)[:, :-1].contiguous()
        batch.positions = (columns - document_starts_of)[:, :-1].contiguous()
    return batch
