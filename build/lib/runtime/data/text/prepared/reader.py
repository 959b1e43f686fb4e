"""Reading prepared datasets: packed sequences by number, mixtures, and the sharded reader.

A prepared dataset of ``T`` tokens holds ``T // (seq_len + 1)`` sequences; sequence ``i`` is the
tokens ``[i * (seq_len + 1), (i + 1) * (seq_len + 1))``, so any sequence is read without reading
the others. :class:`PreparedDataReader` visits them in a permutation drawn from the seed, the
data epoch and the data's fingerprint, and each rank reads only its own share of every step
(see :class:`~runtime.data.MapDataReader`): a rank's work does not grow with the number of ranks.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, final

import numpy as np
import torch
import xxhash
from typing_extensions import override

from gangs import Gang
from runtime.data.data_reader import DataReader, SyncMode
from runtime.data.map_reader import MapDataReader
from runtime.data.permutation import ShuffledOrder
from runtime.data.text.mixture import TextSource
from runtime.data.text.packing import TextBatch, batch_of
from runtime.data.text.prepared.format import PreparedDataError, PreparedDataset
from runtime.data.text.tokenizer import Tokenizer
from trainkit_utils.arguments import check_positive


@final
class PackedRow(NamedTuple):
    """A sequence: its number, its ``seq_len + 1`` tokens, and where (after its first token)
    documents start."""

    sequence_id: int
    tokens: np.ndarray[Any, Any]
    document_starts: np.ndarray[Any, Any]


def collate_rows(rows: Sequence[PackedRow], *, with_documents: bool) -> TextBatch:
    """The batch of ``rows``: one stack of their tokens, and their documents when asked for."""
    tokens = torch.from_numpy(np.stack([row.tokens for row in rows]).astype(np.int64))
    document_starts = None
    if with_documents:
        row_nrs = np.repeat(np.arange(len(rows)), [len(row.document_starts) for row in rows])
        starts = np.concatenate([row.document_starts for row in rows])
        document_starts = (row_nrs.tolist(), starts.tolist())
    batch = batch_of(tokens, document_starts=document_starts)
    batch.sequence_ids = torch.tensor([row.sequence_id for row in rows], dtype=torch.int64)
    return batch


@final
class PackedSequences:
    """The sequences of ``seq_len + 1`` consecutive tokens of a prepared dataset, by number."""

    def __init__(self, dataset: PreparedDataset, *, seq_len: int, document_ids: bool) -> None:
        check_positive("seq_len", seq_len)
        self.dataset = dataset
        # Plain views of the memory maps: slicing a memmap object costs a Python call more.
        self._tokens = dataset.tokens.view(np.ndarray)
        self._document_ends = dataset.document_ends.view(np.ndarray)
        self._window = seq_len + 1
        self._document_ids = document_ids

    def __len__(self) -> int:
        return self.dataset.num_tokens // self._window

    def __getitem__(self, index: int) -> PackedRow:
        if not 0 <= index < len(self):
            raise IndexError(f"Sequence {index} is out of range: the dataset has {len(self)}.")
        start = index * self._window
        tokens = self._tokens[start : start + self._window]
        if not self._document_ids:
            return PackedRow(index, tokens, _NO_STARTS)
        # The documents that end inside the sequence, before its last token, start one.
        ends = self._document_ends
        first = int(ends.searchsorted(start, side="right"))
        last = int(ends.searchsorted(start + self._window - 1, side="right"))
        return PackedRow(index, tokens, ends[first:last] - start)

    def __getitems__(self, indices: Sequence[int]) -> list[PackedRow]:
        return [self[index] for index in indices]


_NO_STARTS = np.zeros(0, dtype=np.int64)


@final
class MixedSequences:
    """The sequences of several datasets in one numbering, each dataset by its weight.

    A data epoch holds ``E = max(n_d / w_d)`` sequences (weights normalized), so every dataset
    is read through at least once: dataset ``d`` gives ``floor(E * w_d)`` of them (and the
    remainder goes to the largest fractions), the first ``n_d`` of its sequences and then
    again from the start. Each epoch starts a dataset where the last one left off, so a
    dataset read 2.5 times an epoch does not favour its first half. The reader shuffles the
    whole numbering, so the datasets mix evenly and their token ratios are the weights'.
    """

    def __init__(self, parts: Sequence[PackedSequences], weights: Sequence[float]) -> None:
        total = sum(weights)
        shares = [weight / total for weight in weights]
        epoch_length = max(
            int(np.ceil(len(part) / share)) for part, share in zip(parts, shares, strict=True)
        )
        counts = [int(epoch_length * share) for share in shares]
        by_fraction = sorted(range(len(parts)), key=lambda d: counts[d] - epoch_length * shares[d])
        for d in by_fraction[: epoch_length - sum(counts)]:
            counts[d] += 1
        # Rounding must not cut a dataset's one pass short.
        counts = [max(count, len(part)) for count, part in zip(counts, parts, strict=True)]
        self.parts = list(parts)
        self.counts = counts
        self._starts = [0, *itertools.accumulate(counts)]
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> PackedRow:
        part_nr = bisect.bisect_right(self._starts, index) - 1
        part, count = self.parts[part_nr], self.counts[part_nr]
        row = part[(self._epoch * count + index - self._starts[part_nr]) % len(part)]
        return row._replace(sequence_id=index)

    def __getitems__(self, indices: Sequence[int]) -> list[PackedRow]:
        return [self[index] for index in indices]


@final
class PreparedDataReader(DataReader[TextBatch]):
    """Reads prepared datasets (``python -m runtime prepare``) as packed, sharded batches.

    The batches are those of :class:`TextDataReader`: ``seq_len + 1`` consecutive tokens a
    sequence, documents running on, with ``document_ids`` and ``positions`` when asked for.
    Epoch ``e`` visits the sequences in a permutation drawn from ``seed``, ``e`` and the data's
    fingerprint; each step takes the next ``batch_size * num_accumulate * gang.size`` of them and
    rank ``r`` reads every ``gang.size``-th from ``r`` on, so it reads only its own. The last
    step that cannot be filled is dropped. Several ``sources`` mix by weight
    (:class:`MixedSequences`).

    The state is the position in the epoch's permutation (epoch, steps, offset), the seed, and
    the fingerprints of the data and its tokenizer; it resumes exactly at another
    data-parallel size, and refuses other data or another tokenizer.
    """

    def __init__(
        self,
        *,
        sources: Sequence[TextSource] | str | Path,
        seq_len: int,
        batch_size: int,
        gang: Gang,
        num_accumulate: int = 1,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        document_ids: bool = False,
        num_prefetch: int = 2,
    ) -> None:
        if isinstance(sources, (str, Path)):
            sources = [TextSource(path=sources)]
        if not sources:
            raise ValueError("sources is empty. Give at least one prepared dataset.")
        self._parts = [
            PackedSequences(
                PreparedDataset(_single_path(source), tokenizer=tokenizer),
                seq_len=seq_len,
                document_ids=document_ids,
            )
            for source in sources
        ]
        self._check_same_tokenizer()
        for part in self._parts:
            if len(part) == 0:
                raise PreparedDataError(
                    f"The prepared dataset {part.dataset.path} holds {part.dataset.num_tokens} "
                    f"tokens, fewer than seq_len + 1 ({seq_len + 1}): not one sequence. Use a "
                    "shorter seq_len or more data."
                )
        self._sequences: PackedSequences | MixedSequences = (
            self._parts[0]
            if len(self._parts) == 1
            else MixedSequences(self._parts, [source.weight for source in sources])
        )
        fingerprints = [
            (part.dataset.fingerprint, source.weight)
            for part, source in zip(self._parts, sources, strict=True)
        ]
        self._fingerprint = xxhash.xxh3_128_hexdigest(repr((fingerprints, seq_len)).encode())
        self._seed = seed
        self._gang = gang
        self._batch_size = batch_size
        self._collate = functools.partial(collate_rows, with_documents=document_ids)
        self._num_prefetch = num_prefetch
        # Not MapDataReader's shuffle: it would permute every sequence on every rank.
        order_seed = xxhash.xxh3_64_intdigest(f"{seed}/{self._fingerprint}".encode())
        self._reader: MapDataReader[TextBatch] = MapDataReader(
            dataset=self._sequences,
            batch_size=batch_size,
            gang=gang,
            collate=self._collate,
            num_accumulate=num_accumulate,
            shuffle=False,
            order=ShuffledOrder(len(self._sequences), seed=order_seed),
            num_prefetch=num_prefetch,
        )

    @override
    def __next__(self) -> list[TextBatch]:
        return next(self._reader)

    @override
    def reset(self) -> None:
        self._reader.reset()

    @override
    def state_dict(self) -> dict[str, object]:
        return {
            **self._reader.state_dict(),
            "data_fingerprint": self._fingerprint,
            "tokenizer_fingerprint": self._parts[0].dataset.tokenizer_fingerprint,
            "user_seed": self._seed,
        }

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved_tokenizer = state.get("tokenizer_fingerprint")
        tokenizer = self._parts[0].dataset.tokenizer_fingerprint
        if saved_tokenizer != tokenizer:
            raise PreparedDataError(
                f"The data position was saved for data of another tokenizer (fingerprint "
                f"{str(saved_tokenizer)[:12]}, now {tokenizer[:12]}). Resume with the tokenizer "
                "and the prepared data of the run that saved it."
            )
        if state.get("user_seed") != self._seed:
            raise PreparedDataError(
                f"The data position was saved with the seed {state.get('user_seed')}, but this "
                f"reader has the seed {self._seed}: its sequences come in another order. Resume "
                "with the seed of the run that saved it."
            )
        if state.get("data_fingerprint") != self._fingerprint:
            raise PreparedDataError(
                f"The data position was saved for other prepared data (fingerprint "
                f"{str(state.get('data_fingerprint'))[:12]}, now {self._fingerprint[:12]}): other "
                "datasets, weights or seq_len. Resume with the data of the run that saved it."
            )
        self._reader.load_state_dict(state)

    @property
    @override
    def num_accumulate(self) -> int:
        return self._reader.num_accumulate

    @property
    def epoch(self) -> int:
        return self._reader.epoch

    @property
    def vocab_size(self) -> int:
        """The vocabulary of the tokenizer that prepared the data."""
        return self._parts[0].dataset.vocab_size

    @property
    def num_sequences(self) -> int:
        """The sequences of a data epoch, the whole gang's."""
        return len(self._sequences)

    @override
    def for_evaluation(self) -> MapDataReader[TextBatch]:
        """Every sequence of every dataset once, in order, the last partial batch kept."""
        sequences = self._parts[0] if len(self._parts) == 1 else _Concatenated(self._parts)
        return MapDataReader(
            dataset=sequences,
            batch_size=self._batch_size,
            gang=self._gang,
            collate=self._collate,
            shuffle=False,
            drop_remainder=False,
            sync_mode=SyncMode.UNTIL_LAST,
            num_prefetch=self._num_prefetch,
        )

    @override
    def close(self) -> None:
        self._reader.close()

    def _check_same_tokenizer(self) -> None:
        fingerprints = {part.dataset.tokenizer_fingerprint for part in self._parts}
        if len(fingerprints) > 1:
            paths = ", ".join(str(part.dataset.path) for part in self._parts)
            raise PreparedDataError(
                f"The prepared datasets of the mixture ({paths}) were made with different "
                "tokenizers. Prepare them all with the tokenizer of the run."
            )


@final
class _Concatenated:
    """Several datasets' sequences one after another."""

    def __init__(self, parts: Sequence[PackedSequences]) -> None:
        self._parts = parts
        self._starts = [0, *itertools.accumulate(len(part) for part in parts)]

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> PackedRow:
        part_nr = bisect.bisect_right(self._starts, index) - 1
        return self._parts[part_nr][index - self._starts[part_nr]]._replace(sequence_id=index)


def _single_path(source: TextSource) -> Path:
    if len(source.paths) != 1:
        raise ValueError(
            f"A prepared dataset is one directory, but the source lists {source.paths}. Give "
            "each prepared directory as a dataset of its own (a mixture entry)."
        )
    return Path(source.paths[0])
