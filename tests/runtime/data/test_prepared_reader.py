"""Reading prepared datasets: packed batches, the order, each rank's share, resume, mixtures."""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks.stand_in_gang import RankGang
from gangs import FakeGang, Gang
from runtime.data.text import (
    ByteTokenizer,
    PreparedDataError,
    PreparedDataReader,
    TextBatch,
    TextSource,
    prepare_dataset,
)
from runtime.data.text.prepared import MixedSequences, PackedSequences, PreparedDataset
from tests.conftest import make_tokenizer_dir

EOS = ByteTokenizer().eos_id
Row = tuple[int, ...]


def prepare_text(directory: Path, texts: Sequence[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "text.txt").write_text("".join(text + "\n" for text in texts))
    prepare_dataset(
        directory / "prepared", [directory / "text.txt"], tokenizer=ByteTokenizer(), num_workers=0
    )
    return directory / "prepared"


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return prepare_text(
        tmp_path / "data", [f"document {i:03d} " + "x" * (i % 17) for i in range(250)]
    )


def reader(
    path: Path | Sequence[TextSource], *, gang: Gang | None = None, **kwargs: object
) -> PreparedDataReader:
    options: dict[str, object] = {"seq_len": 32, "batch_size": 4, "num_prefetch": 0}
    options.update(kwargs)
    return PreparedDataReader(sources=path, gang=gang or FakeGang(), **options)  # type: ignore[arg-type]


def rows_of(batches: Sequence[TextBatch]) -> list[Row]:
    return [
        (*inputs, targets[-1])
        for batch in batches
        for inputs, targets in zip(batch.input_ids.tolist(), batch.target_ids.tolist(), strict=True)
    ]


def all_sequences(path: Path) -> set[Row]:
    sequences = PackedSequences(PreparedDataset(path), seq_len=32, document_ids=False)
    return {tuple(sequences[i].tokens.tolist()) for i in range(len(sequences))}


def test_batches_are_packed_sequences_whose_documents_restart_after_each_eos(data: Path) -> None:
    batches = next(reader(data, document_ids=True, num_accumulate=2))
    assert len(batches) == 2
    for batch in batches:
        assert batch.input_ids.shape == batch.target_ids.shape == (4, 32)
        assert batch.num_targets == 128
        assert batch.input_ids[:, 1:].equal(batch.target_ids[:, :-1])
        assert batch.document_ids is not None and batch.positions is not None
        for tokens, ids, positions in zip(
            batch.input_ids.tolist(),
            batch.document_ids.tolist(),
            batch.positions.tolist(),
            strict=True,
        ):
            document, position = 0, 0
            for column, token in enumerate(tokens):
                assert (ids[column], positions[column]) == (document, position)
                document, position = (document + 1, 0) if token == EOS else (document, position + 1)


def test_the_order_is_drawn_from_the_seed_the_epoch_and_the_data(
    tmp_path: Path, data: Path
) -> None:
    def epochs(read: PreparedDataReader) -> list[list[Row]]:
        first = [row for batches in read for row in rows_of(batches)]
        read.reset()
        return [first, [row for batches in read for row in rows_of(batches)]]

    first, second = epochs(reader(data))
    assert epochs(reader(data)) == [first, second]
    assert epochs(reader(data, seed=1))[0] != first
    assert first != second  # every data epoch reshuffles
    num_sequences = reader(data).num_sequences
    assert len(first) == len(set(first)) == num_sequences // 4 * 4  # the last partial step dropped
    assert set(first) <= all_sequences(data) and set(second) <= all_sequences(data)

    other = prepare_text(
        tmp_path / "other", [f"document {i:03d} " + "y" * (i % 17) for i in range(250)]
    )

    def sequence_ids(path: Path) -> list[int]:
        return [i for batch in next(reader(path)) for i in batch.sequence_ids.tolist()]

    assert reader(other).num_sequences == reader(data).num_sequences
    assert sequence_ids(other) != sequence_ids(data)


def test_each_rank_reads_only_its_own_sequences_and_together_the_gangs_steps(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_indices: list[int] = []
    getitem = PackedSequences.__getitem__

    def counting(self: PackedSequences, index: int) -> object:
        read_indices.append(index)
        return getitem(self, index)

    monkeypatch.setattr(PackedSequences, "__getitem__", counting)
    whole = reader(data, batch_size=6)
    whole_steps = [set(rows_of(next(whole))) for _ in range(5)]

    for size in (2, 3):
        ranks = [
            reader(data, batch_size=6 // size, gang=RankGang(rank=r, size=size))
            for r in range(size)
        ]
        steps: list[set[Row]] = [set() for _ in range(5)]
        for rank in ranks:
            read_indices.clear()
            for step in steps:
                step.update(rows_of(next(rank)))
            assert len(read_indices) == len(set(read_indices)) == 5 * 6 // size
        assert steps == whole_steps


def test_a_position_resumes_exactly_at_another_data_parallel_size(data: Path) -> None:
    whole = reader(data, batch_size=6)
    expected = [set(rows_of(next(whole))) for _ in range(8)]

    def run(
        size: int, state: dict[str, object] | None, num_steps: int
    ) -> tuple[list[set[Row]], dict[str, object]]:
        ranks = [
            reader(data, batch_size=6 // size, gang=RankGang(rank=r, size=size))
            for r in range(size)
        ]
        steps: list[set[Row]] = [set() for _ in range(num_steps)]
        for rank in ranks:
            if state is not None:
                rank.load_state_dict(state)
            for step in steps:
                step.update(rows_of(next(rank)))
        states = [rank.state_dict() for rank in ranks]
        assert all(s == states[0] for s in states)
        return steps, states[0]

    first, state = run(2, None, 3)
    then, state = run(1, state, 2)
    last, _ = run(3, state, 3)
    assert first + then + last == expected


def test_a_resume_with_other_data_or_another_tokenizer_is_refused_in_one_line(
    tmp_path: Path, data: Path
) -> None:
    state = reader(data).state_dict()
    other = prepare_text(tmp_path / "other", ["other text " * 40] * 20)
    with pytest.raises(PreparedDataError, match="saved for other prepared data") as refused:
        reader(other).load_state_dict(state)
    assert "\n" not in str(refused.value)

    from runtime.data.text import HuggingFaceTokenizer

    words = make_tokenizer_dir(tmp_path / "tokenizer", ["document x"])
    (tmp_path / "text.txt").write_text("document x x\n" * 400)
    prepare_dataset(
        tmp_path / "words",
        [tmp_path / "text.txt"],
        tokenizer=HuggingFaceTokenizer(words),
        num_workers=0,
    )
    with pytest.raises(PreparedDataError, match="data of another tokenizer"):
        reader(tmp_path / "words").load_state_dict(state)
    with pytest.raises(PreparedDataError, match="tokenized by another tokenizer"):
        reader(tmp_path / "words", tokenizer=ByteTokenizer())


def test_a_mixture_keeps_the_weights_token_ratios_and_reads_each_dataset_through(
    tmp_path: Path,
) -> None:
    rng = random.Random(0)
    small = prepare_text(tmp_path / "a", ["".join(rng.choices("abc", k=40)) for _ in range(60)])
    large = prepare_text(tmp_path / "b", ["".join(rng.choices("xyz", k=40)) for _ in range(300)])
    mixed = reader([TextSource(path=small, weight=3), TextSource(path=large, weight=1)])
    epoch = [row for batches in mixed for row in rows_of(batches)]
    from_large = [row for row in epoch if {ord("x"), ord("y"), ord("z")} & set(row)]
    assert len(from_large) / len(epoch) == pytest.approx(0.25, abs=0.01)
    # The large dataset's one pass, but for the few sequences of the dropped last step.
    assert len(all_sequences(large) - set(from_large)) < 4
    assert set(epoch) - set(from_large) == all_sequences(small)  # read 9 times over

    with pytest.raises(PreparedDataError, match="fewer than seq_len"):
        reader(prepare_text(tmp_path / "tiny", ["a"]))


def test_evaluation_reads_every_sequence_once_over_uneven_ranks(data: Path) -> None:
    seen: collections.Counter[Row] = collections.Counter()
    steps = []
    for rank in range(3):
        valid = reader(data, gang=RankGang(rank=rank, size=3), batch_size=4).for_evaluation()
        batches = list(valid)
        steps.append(len(batches))
        seen.update(row for step in batches for row in rows_of(step))
    assert len(set(steps)) == 1  # every rank takes part in every step, some with []
    assert set(seen) == all_sequences(data)
    assert set(seen.values()) == {1} and sum(seen.values()) == reader(data).num_sequences


def test_a_dataset_read_more_than_once_an_epoch_goes_on_where_the_last_epoch_left_off(
    tmp_path: Path,
) -> None:
    small, large = (
        PackedSequences(
            PreparedDataset(prepare_text(tmp_path / name, [name * size])),
            seq_len=32,
            document_ids=False,
        )
        for name, size in (("a", 90), ("b", 300))
    )
    mixed = MixedSequences([small, large], [1, 1])
    assert (len(small), len(large), mixed.counts) == (2, 9, [9, 9])

    def small_rows() -> list[int]:
        return [int(mixed[i].tokens[0] == small[1].tokens[0]) for i in range(9)]

    mixed.set_epoch(0)
    assert small_rows() == [0, 1, 0, 1, 0, 1, 0, 1, 0]
    mixed.set_epoch(1)
    assert small_rows() == [1, 0, 1, 0, 1, 0, 1, 0, 1]  # 9 more: it starts on the second
    assert [mixed[i].sequence_id for i in (0, 9, 17)] == [0, 9, 17]
