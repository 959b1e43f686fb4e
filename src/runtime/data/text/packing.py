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
    num_bad_lines: int = 0
    """Lines the reader had skipped (``skip_bad_lines``) when it made this batch, so a unit can
    publish the count."""

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)


def make_batch(rows: Sequence[Sequence[Tensor]], *, with_documents: bool) -> TextBatch:
    """The batch of ``rows``, each the pieces (one per document) of ``seq_len + 1`` tokens."""
    tokens = torch.stack([torch.cat(list(pieces)) for pieces in rows]).long()
    batch = TextBatch(
        input_ids=tokens[:, :-1].contiguous(),
        target_ids=tokens[:, 1:].contiguous(),
        num_targets=tokens.shape[0] * (tokens.shape[1] - 1),
    )
    if with_documents:
        documents = [_documents_of(pieces) for pieces in rows]
        batch.document_ids = torch.stack([ids for ids, _ in documents])[:, :-1].contiguous()
        batch.positions = torch.stack([pos for _, pos in documents])[:, :-1].contiguous()
    return batch


def _documents_of(pieces: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    lengths = torch.tensor([len(piece) for piece in pieces])
    ids = torch.repeat_interleave(torch.arange(len(pieces)), lengths)
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return ids, torch.arange(int(lengths.sum())) - starts
