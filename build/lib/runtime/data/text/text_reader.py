"""Reading text datasets as packed, sharded, exactly resumable micro-batches of token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, final

from torch import Tensor
from typing_extensions import override

from gangs import Gang, find_disagreements
from runtime.data.data_reader import DataReader, DataReaderError, int_entry
from runtime.data.text.files import ReadOptions, find_files
from runtime.data.text.mixture import MixtureSampler, TextSource
from runtime.data.text.packing import TextBatch, make_batch
from runtime.data.text.stream import Cursor, DocumentStream
from runtime.data.text.tokenizer import Tokenizer
from runtime.data.text.workers import ChunkReader, make_chunk_reader
from trainkit_utils.arguments import check_not_negative, check_positive

_CURSOR_FIELDS = ("pass_nr", "file_nr", "offset", "token_nr")


@final
class TextDataReader(DataReader[TextBatch]):
    """Packs the documents of one or more text datasets into sequences of ``seq_len`` tokens.

    Each document becomes ``[BOS] tokens [EOS]`` (BOS when the tokenizer has one and ``add_bos``)
    and the documents run on from one sequence into the next, so no token is padding; each
    sequence holds ``seq_len + 1`` tokens, its inputs and its targets shifted by one.

    With several ``sources``, each sequence comes from one dataset drawn by weight (see
    :class:`MixtureSampler`), so the token ratios are the weights' ratios; a dataset read to its
    end goes on with its next pass, and the data epoch ends at the first step by which every
    dataset was read to its end. The step that cannot be filled then is dropped.

    Every rank packs the same global sequence stream and keeps every ``gang.size``-th sequence,
    so the ranks agree on the epoch's end without communicating, and the position (each
    dataset's file, document and token, and the number of sequences taken) is the same on every
    rank: it resumes exactly, at any data-parallel size. Tokenizing runs in ``num_workers``
    processes (in this one with 0); they keep no position, so nothing is lost when one dies.
    """

    def __init__(
        self,
        *,
        sources: Sequence[TextSource] | str | Path,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        gang: Gang,
        num_accumulate: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        text_field: str = "text",
        skip_bad_lines: bool = False,
        document_ids: bool = False,
        shuffle_files: bool = True,
        add_bos: bool = True,
        chunk_bytes: int = 1 << 20,
        read_ahead: int | None = None,
    ) -> None:
        check_positive("seq_len", seq_len)
        check_positive("batch_size", batch_size)
        check_positive("num_accumulate", num_accumulate)
        check_not_negative("num_workers", num_workers)
        check_positive("chunk_bytes", chunk_bytes)
        if isinstance(sources, (str, Path)):
            sources = [TextSource(path=sources)]
        if not sources:
            raise ValueError("sources is empty. Give at least one dataset.")

        self._options = ReadOptions(
            tokenizer=tokenizer,
            text_field=text_field,
            skip_bad_lines=skip_bad_lines,
            add_bos=add_bos,
            chunk_bytes=chunk_bytes,
        )
        self._num_workers = num_workers
        depth = read_ahead if read_ahead is not None else max(2, 2 * num_workers)
        check_positive("read_ahead", depth)
        self._streams = [
            DocumentStream(
                files=[file for path in source.paths for file in find_files(path)],
                options=self._options,
                seed=f"{seed}/{nr}",
                shuffle_files=shuffle_files,
                depth=depth,
            )
            for nr, source in enumerate(sources)
        ]
        self._sampler = MixtureSampler([source.weight for source in sources], seed=seed)
        self._chunk_reader: ChunkReader | None = None
        self._gang = gang
        self._seq_len = seq_len
        self._batch_size = batch_size
        self._num_accumulate = num_accumulate
        self._seed = seed
        self._shuffle_files = shuffle_files
        self._document_ids = document_ids

        self._epoch = 0
        self._step_nr = 0
        self._sequence_nr = 0  # sequences of the whole gang taken in this epoch
        self._epoch_done = False
        self._verified = False

    @override
    def __next__(self) -> list[TextBatch]:
        if self._epoch_done:
            raise StopIteration
        if not self._verified:
            self._verify_ranks_agree()
            self._verified = True
        self._attach_reader()

        gang_size, rank = self._gang.size, self._gang.rank
        rows: list[list[Tensor]] = []
        for index in range(self._batch_size * self._num_accumulate * gang_size):
            pieces = self._next_sequence(self._sequence_nr + index)
            if pieces is None:
                self._epoch_done = True
                raise StopIteration
            if index % gang_size == rank:
                rows.append(pieces)
        self._sequence_nr += self._batch_size * self._num_accumulate * gang_size
        self._step_nr += 1
        size = self._batch_size
        batches = [
            make_batch(rows[start : start + size], with_documents=self._document_ids)
            for start in range(0, len(rows), size)
        ]
        for batch in batches:
            batch.num_bad_lines = self.num_bad_lines
        return batches

    @override
    def for_evaluation(self) -> TextDataReader:
        raise ValueError(
            "A TextDataReader packs a stream and drops its last partial step, so a score over it "
            "would leave out the end of the valid set. Tokenize the valid set and read it with "
            "MapDataReader (it keeps every example) as valid_data_readers."
        )

    @override
    def reset(self) -> None:
        self._go_to(epoch=self._epoch + 1, cursors=[Cursor()] * len(self._streams))
        self._step_nr = self._sequence_nr = 0
        self._epoch_done = False

    @override
    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {
            "epoch": self._epoch,
            "step_nr": self._step_nr,
            "sequence_nr": self._sequence_nr,
            "epoch_done": self._epoch_done,
            "seed": self._seed,
            "shuffle_files": self._shuffle_files,
            "num_sources": len(self._streams),
            "step_size": self._batch_size * self._num_accumulate * self._gang.size,
        }
        for nr, stream in enumerate(self._streams):
            state[f"source_{nr}_num_files"] = stream.num_files
            cursor = vars(stream.cursor)
            state.update({f"source_{nr}_{name}": cursor[name] for name in _CURSOR_FIELDS})
        return state

    @override
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = {
            "seed": int_entry(state, "seed"),
            "shuffle_files": int_entry(state, "shuffle_files"),
        }
        saved["num_sources"] = int_entry(state, "num_sources")
        here = {"seed": self._seed, "shuffle_files": int(self._shuffle_files)}
        here["num_sources"] = len(self._streams)
        for nr, stream in enumerate(self._streams[: saved["num_sources"]]):
            saved[f"source_{nr}_num_files"] = int_entry(state, f"source_{nr}_num_files")
            here[f"source_{nr}_num_files"] = stream.num_files
        if saved != here:
            differ = ", ".join(
                f"{key} {saved.get(key)} (now {value})"
                for key, value in here.items()
                if saved.get(key) != value
            )
            raise ValueError(
                f"The text data position was saved with other data: {differ}. Resume with the "
                "same datasets, files, seed and shuffle_files as the run that saved it."
            )
        cursors = [
            Cursor(**{name: int_entry(state, f"source_{nr}_{name}") for name in _CURSOR_FIELDS})
            for nr in range(len(self._streams))
        ]
        self._go_to(epoch=int_entry(state, "epoch"), cursors=cursors)
        self._sequence_nr = int_entry(state, "sequence_nr")
        self._epoch_done = bool(int_entry(state, "epoch_done"))
        # The step number counts this layout's steps; another layout took other-sized steps.
        self._step_nr = self._sequence_nr // (
            self._batch_size * self._num_accumulate * self._gang.size
        )

    @property
    @override
    def num_accumulate(self) -> int:
        return self._num_accumulate

    @property
    def epoch(self) -> int:
        """The number of the current data epoch, from 0."""
        return self._epoch

    @property
    def num_bad_lines(self) -> int:
        """Lines skipped as bad (with ``skip_bad_lines``) since this reader was built; every
        rank reads every line, so the count is the same on every rank."""
        return sum(stream.num_bad_lines for stream in self._streams)

    @override
    def close(self) -> None:
        if self._chunk_reader is not None:
            self._chunk_reader.close()
            self._chunk_reader = None

    def _next_sequence(self, sequence_nr: int) -> list[Tensor] | None:
        """The pieces of the epoch's sequence ``sequence_nr``, or None when the epoch ended."""
        stream = self._streams[self._sampler.choose(epoch=self._epoch, sequence_nr=sequence_nr)]
        pieces: list[Tensor] = []
        missing = self._seq_len + 1
        while missing > 0:
            taken, pass_ended = stream.take(missing)
            pieces.extend(taken)
            missing -= sum(len(piece) for piece in taken)
            if pass_ended and all(other.cursor.pass_nr > 0 for other in self._streams):
                return None
        return pieces

    def _go_to(self, *, epoch: int, cursors: Sequence[Cursor]) -> None:
        self._epoch = epoch
        for stream, cursor in zip(self._streams, cursors, strict=True):
            stream.start(epoch=epoch, cursor=cursor)
        self._verified = False

    def _attach_reader(self) -> None:
        if self._chunk_reader is None:
            self._chunk_reader = make_chunk_reader(self._options, num_workers=self._num_workers)
            for stream in self._streams:
                stream.attach(self._chunk_reader)

    def _verify_ranks_agree(self) -> None:
        # A rank set up differently would pack another stream and take the wrong sequences.
        values = {
            "seq_len": self._seq_len,
            "batch_size": self._batch_size,
            "num_accumulate": self._num_accumulate,
            "seed": self._seed % (1 << 62),
            "data epoch": self._epoch,
            "sequence": self._sequence_nr,
        }
        values.update({f"files of dataset {nr}": s.num_files for nr, s in enumerate(self._streams)})
        differ = find_disagreements(self._gang, values)
        if differ:
            described = ", ".join(
                f"{name} ({low} to {high})" for name, (low, high) in differ.items()
            )
            raise DataReaderError(
                f"The {self._gang.size} ranks of the data-parallel gang disagree on the text "
                f"data: {described}. Build every rank's reader with the same files and settings, "
                "and load every rank's reader state from the same checkpoint."
            )

    def __del__(self) -> None:
        if getattr(self, "_chunk_reader", None) is not None:
            self.close()
