"""Prepared text datasets: tokenized once (``python -m runtime prepare``), read by any rank count."""

from __future__ import annotations

from runtime.data.text.prepared.format import (
    PreparedDataError,
    PreparedDataset,
    is_prepared_dataset,
)
from runtime.data.text.prepared.reader import MixedSequences, PackedSequences, PreparedDataReader
from runtime.data.text.prepared.writer import prepare_dataset

__all__ = [
    "MixedSequences",
    "PackedSequences",
    "PreparedDataError",
    "PreparedDataReader",
    "PreparedDataset",
    "is_prepared_dataset",
    "prepare_dataset",
]
