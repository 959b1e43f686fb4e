"""Preparing text datasets: the tokens, the manifest, continuing after a failure, and refusals."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typing_extensions import override

import runtime.data.text.prepared.format as prepared_format
import runtime.data.text.prepared.writer as writer
from gangs import Gangs
from runtime.data.text import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    PreparedDataError,
    PreparedDataset,
    TextDataError,
    TextDataReader,
    TextSource,
    Tokenizer,
    is_prepared_dataset,
    prepare_dataset,
)
from tests.conftest import WORDS, make_tokenizer_dir


def documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(count)]


def write_corpus(directory: Path) -> list[Path]:
    """A user's files: JSONL with another field beside the text, plain text, and Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    jsonl, txt, parquet = directory / "a.jsonl", directory / "b.txt", directory / "c.parquet"
    jsonl.write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(documents(300, 0)))
    )
    txt.write_text("".join(t + "\n" for t in documents(200, 1)))
    pq.write_table(pa.table({"text": documents(150, 2)}), parquet, row_group_size=64)
    return [jsonl, txt, parquet]


@pytest.fixture
def corpus(tmp_path: Path) -> list[Path]:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def tokenizer(tmp_path: Path) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(make_tokenizer_dir(tmp_path / "tokenizer", WORDS))


def read_documents(files: Sequence[Path]) -> list[str]:
    import pyarrow.parquet as pq

    texts: list[str] = []
    for file in files:
        if file.suffix == ".jsonl":
            texts += [json.loads(line)["text"] for line in file.read_text().splitlines()]
        elif file.suffix == ".txt":
            texts += file.read_text().splitlines()
        else:
            texts += pq.read_table(file).column("text").to_pylist()
    return texts


def test_the_tokens_are_each_document_between_bos_and_eos_in_file_order(
    tmp_path: Path, corpus: list[Path], tokenizer: HuggingFaceTokenizer
) -> None:
    # Worker processes tokenize in tests/runtime/cli/test_prepare_command.py.
    dataset = prepare_dataset(
        tmp_path / "out", corpus, tokenizer=tokenizer, num_workers=0, chunk_bytes=4096
    )

    expected = [[1, *tokenizer.encode(text), 2] for text in read_documents(corpus)]
    assert dataset.tokens.dtype == np.dtype("<u2")
    assert dataset.tokens.tolist() == [token for document in expected for token in document]
    assert dataset.document_ends.tolist() == np.cumsum([len(d) for d in expected]).tolist()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_documents"] == len(expected) == 650
    assert manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    assert [source["path"] for source in manifest["sources"]] == [str(path) for path in corpus]
    assert all(len(source["digest"]) == 32 for source in manifest["sources"])
    assert manifest["version"] == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "documents.bin",
        "manifest.json",
        "tokens.bin",
    ]
    dataset.verify()


def test_the_tokens_are_the_stream_the_text_reader_packs(
    tmp_path: Path, corpus: list[Path], tokenizer: HuggingFaceTokenizer
) -> None:
    dataset = prepare_dataset(tmp_path / "out", corpus, tokenizer=tokenizer, num_workers=0)
    reader = TextDataReader(
        sources=[TextSource(path=[str(path) for path in corpus])],
        tokenizer=tokenizer,
        seq_len=31,
        batch_size=1,
        gang=Gangs.single().dp,
        shuffle_files=False,
    )
    rows = [batch.input_ids[0].tolist() + batch.target_ids[0, -1:].tolist() for [batch] in reader]
    packed = [token for row in rows for token in row]
    assert packed == dataset.tokens[: len(packed)].tolist()
    assert len(packed) == dataset.num_tokens // 32 * 32


class WideTokenizer(Tokenizer):
    """A user's tokenizer of 70,000 ids: characters shifted past 65,536."""

    @override
    def encode(self, text: str) -> list[int]:
        return [66_000 + ord(char) % 1000 for char in text]

    @override
    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - 66_000) for i in ids)

    eos_id = property(lambda self: 0)
    bos_id = property(lambda self: None)
    vocab_size = property(lambda self: 70_000)


def test_a_vocabulary_past_65536_ids_is_stored_as_int32(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\nworld\n")
    dataset = prepare_dataset(
        tmp_path / "out", [tmp_path / "a.txt"], tokenizer=WideTokenizer(), num_workers=0
    )
    assert dataset.tokens.dtype == np.dtype("<i4")
    assert dataset.tokens.tolist()[:6] == [66_104, 66_101, 66_108, 66_108, 66_111, 0]
    assert dataset.manifest["dtype"] == "int32"


def test_bad_lines_stop_with_the_text_readers_error_or_are_skipped_and_counted(
    tmp_path: Path,
) -> None:
    data = tmp_path / "a.jsonl"
    data.write_text('{"text": "one"}\nnot json\n{"body": "x"}\n{"text": "two"}\n')
    with pytest.raises(TextDataError, match=r"a.jsonl: line 2: the line is not JSON"):
        prepare_dataset(tmp_path / "out", [data], tokenizer=ByteTokenizer(), num_workers=0)
    assert not (tmp_path / "out" / "manifest.json").exists()

    dataset = prepare_dataset(
        tmp_path / "skipped", [data], tokenizer=ByteTokenizer(), skip_bad_lines=True, num_workers=0
    )
    assert dataset.manifest["num_bad_lines"] == 2
    assert dataset.num_documents == 2
    assert ByteTokenizer().decode(dataset.tokens.tolist()) == "onetwo"


def test_a_failure_mid_way_leaves_no_dataset_and_the_rerun_goes_on_from_the_finished_chunks(
    tmp_path: Path, corpus: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    save_piece = writer._save_piece
    saved: list[str] = []

    def fill_the_disk(path: Path, **arrays: Any) -> None:
        if len(saved) == 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        save_piece(path, **arrays)
        saved.append(path.name)

    monkeypatch.setattr(writer, "_save_piece", fill_the_disk)
    with pytest.raises(OSError, match="No space left"):
        prepare_dataset(
            tmp_path / "out", corpus, tokenizer=ByteTokenizer(), num_workers=0, chunk_bytes=2048
        )
    assert is_prepared_dataset(tmp_path / "out")
    with pytest.raises(PreparedDataError, match=r"unfinished .* Run the same"):
        PreparedDataset(tmp_path / "out")

    monkeypatch.setattr(writer, "_save_piece", save_piece)
    lines: list[str] = []
    dataset = prepare_dataset(
        tmp_path / "out",
        corpus,
        tokenizer=ByteTokenizer(),
        num_workers=0,
        chunk_bytes=2048,
        report=lines.append,
    )
    num_chunks = len(writer._tasks(writer._unique_files(corpus), _options(2048)))
    assert (
        lines[0] == f"Going on with {num_chunks - 5} of {num_chunks} chunks; the others are done."
    )
    fresh = prepare_dataset(tmp_path / "fresh", corpus, tokenizer=ByteTokenizer(), num_workers=0)
    assert dataset.fingerprint == fresh.fingerprint
    assert (tmp_path / "out" / "tokens.bin").read_bytes() == (
        tmp_path / "fresh" / "tokens.bin"
    ).read_bytes()
    assert not (tmp_path / "out" / ".prepare").exists()


def _options(chunk_bytes: int) -> Any:
    from runtime.data.text.files import ReadOptions

    return ReadOptions(tokenizer=ByteTokenizer(), chunk_bytes=chunk_bytes)


def test_a_finished_dataset_is_kept_and_another_is_refused_in_its_directory(
    tmp_path: Path, corpus: list[Path]
) -> None:
    out = tmp_path / "out"
    first = prepare_dataset(out, corpus, tokenizer=ByteTokenizer(), num_workers=0)
    lines: list[str] = []
    again = prepare_dataset(
        out, corpus, tokenizer=ByteTokenizer(), report=lines.append, num_workers=0
    )
    assert again.fingerprint == first.fingerprint
    assert lines == [f"{out} already holds this dataset, prepared from the same inputs."]

    with pytest.raises(PreparedDataError, match=r"already holds a prepared dataset .*sources"):
        prepare_dataset(out, corpus[:1], tokenizer=ByteTokenizer(), num_workers=0)
    PreparedDataset(out).verify()

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(PreparedDataError, match=r"not empty and holds no prepared dataset"):
        prepare_dataset(tmp_path / "mine", corpus, tokenizer=ByteTokenizer(), num_workers=0)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


class Killed(BaseException):
    """The process dies here: nothing of the writer runs after it (no except, no cleanup)."""


# The writer's steps on disk: each directory made, file saved or renamed, entry removed, and each
# chunk read back while joining. A kill can land before any one of them.
DISK_STEPS: list[tuple[Any, str]] = [
    (os, "mkdir"),
    (os, "replace"),
    (os, "unlink"),
    (os, "remove"),
    (os, "rmdir"),
    (writer, "write_json_durably"),
    (prepared_format, "write_json_durably"),
    (writer, "_save_piece"),
    (np, "load"),
]


@contextmanager
def kill_at(kill: Callable[[int], bool]) -> Iterator[list[str]]:
    """Raise Killed before the first disk step ``nr`` for which ``kill(nr)``; yields the names of
    the steps taken."""
    taken: list[str] = []

    def killable(run: Callable[..., Any], name: str) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if kill(len(taken)):
                raise Killed(name)
            taken.append(name)
            return run(*args, **kwargs)

        return step

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in DISK_STEPS:
            patch.setattr(owner, name, killable(getattr(owner, name), name))
        yield taken


DATASET_FILES = ["documents.bin", "manifest.json", "tokens.bin"]


def small_corpus(directory: Path) -> list[Path]:
    directory.mkdir()
    paths = [directory / "a.jsonl", directory / "b.jsonl"]
    for seed, path in enumerate(paths):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(12, seed)))
    return paths


def prepare_small(out: Path, inputs: Sequence[Path]) -> PreparedDataset:
    return prepare_dataset(out, inputs, tokenizer=ByteTokenizer(), num_workers=0, chunk_bytes=1024)


def test_a_kill_before_any_step_on_disk_leaves_a_directory_the_same_command_finishes(
    tmp_path: Path,
) -> None:
    inputs = small_corpus(tmp_path / "corpus")
    with kill_at(lambda nr: False) as steps:
        prepare_small(tmp_path / "whole", inputs)
    expected = {name: (tmp_path / "whole" / name).read_bytes() for name in DATASET_FILES}
    assert {"_save_piece", "load", "replace", "write_json_durably", "rmdir"} <= set(steps)

    for nr, step in enumerate(steps):
        out = tmp_path / f"killed_before_step_{nr}"
        with pytest.raises(Killed), kill_at(lambda taken, nr=nr: taken == nr):
            prepare_small(out, inputs)
        if (out / "manifest.json").is_file():
            PreparedDataset(out).verify()  # past the commit point: a whole dataset
        else:
            with pytest.raises(PreparedDataError, match=r"unfinished|not a prepared dataset"):
                PreparedDataset(out)

        prepare_small(out, inputs).verify()
        where = f"killed before step {nr} ({step})"
        assert sorted(entry.name for entry in out.iterdir()) == DATASET_FILES, where
        assert {name: (out / name).read_bytes() for name in DATASET_FILES} == expected, where


def killed_with_the_files_in_place(out: Path, inputs: Sequence[Path]) -> None:
    """Kill a preparation once the dataset's files are in ``out``, before it has a manifest."""
    with pytest.raises(Killed), kill_at(lambda nr: (out / "documents.bin").is_file()):
        prepare_small(out, inputs)
    assert not (out / "manifest.json").exists()


def test_an_unfinished_preparation_is_started_over_for_other_inputs_and_foreign_files_refused(
    tmp_path: Path,
) -> None:
    inputs = small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    killed_with_the_files_in_place(out, inputs)
    lines: list[str] = []
    with kill_at(lambda nr: False) as steps:
        prepare_dataset(
            out,
            inputs[:1],
            tokenizer=ByteTokenizer(),
            num_workers=0,
            chunk_bytes=1024,
            report=lines.append,
        )
    assert lines[0] == (
        f"Discarding the unfinished preparation in {out / '.prepare'}: it had other inputs or "
        "settings."
    )
    prepare_small(tmp_path / "fresh", inputs[:1])
    expected = {name: (tmp_path / "fresh" / name).read_bytes() for name in DATASET_FILES}
    assert {name: (out / name).read_bytes() for name in DATASET_FILES} == expected

    # A kill while discarding, or anywhere after, and the rerun still gives the fresh dataset.
    for nr, step in enumerate(steps):
        again = tmp_path / f"killed_again_before_step_{nr}"
        killed_with_the_files_in_place(again, inputs)
        with pytest.raises(Killed), kill_at(lambda taken, nr=nr: taken == nr):
            prepare_small(again, inputs[:1])
        prepare_small(again, inputs[:1])
        where = f"killed again before step {nr} ({step})"
        assert sorted(entry.name for entry in again.iterdir()) == DATASET_FILES, where
        assert {name: (again / name).read_bytes() for name in DATASET_FILES} == expected, where

    # The writer's own files are known by name; anything else beside them is the user's.
    mine = tmp_path / "mine"
    killed_with_the_files_in_place(mine, inputs)
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(PreparedDataError, match=r"not empty and holds no prepared dataset .*notes"):
        prepare_small(mine, inputs)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_the_same_inputs_named_another_way_are_the_same_dataset(
    tmp_path: Path, corpus: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(corpus[0].parent)
    out = tmp_path / "out"
    first = prepare_dataset(out, ["a.jsonl", "b.txt"], tokenizer=ByteTokenizer(), num_workers=0)
    (tmp_path / "link.txt").symlink_to(corpus[1])
    for spelling in (["./a.jsonl", "b.txt"], [corpus[0], tmp_path / "link.txt"]):
        lines: list[str] = []
        again = prepare_dataset(
            out, spelling, tokenizer=ByteTokenizer(), report=lines.append, num_workers=0
        )
        assert again.fingerprint == first.fingerprint
        assert lines == [f"{out} already holds this dataset, prepared from the same inputs."]

    # Sources that really differ are still refused: another order, or other bytes.
    with pytest.raises(PreparedDataError, match=r"other inputs or settings \(the sources differ"):
        prepare_dataset(out, ["b.txt", "./a.jsonl"], tokenizer=ByteTokenizer(), num_workers=0)
    corpus[1].write_text("other words\n")
    with pytest.raises(PreparedDataError, match=r"other inputs or settings \(the sources differ"):
        prepare_dataset(out, ["./a.jsonl", "b.txt"], tokenizer=ByteTokenizer(), num_workers=0)
    PreparedDataset(out).verify()

    # Work a kill left unfinished goes on under another spelling too.
    unfinished, chunks = tmp_path / "unfinished", tmp_path / "unfinished" / ".prepare" / "chunks"
    with pytest.raises(Killed), kill_at(lambda nr: len(list(chunks.glob("*.npz"))) == 2):
        prepare_dataset(
            unfinished, ["a.jsonl"], tokenizer=ByteTokenizer(), chunk_bytes=4096, num_workers=0
        )
    lines = []
    prepare_dataset(
        unfinished,
        ["./a.jsonl"],
        tokenizer=ByteTokenizer(),
        chunk_bytes=4096,
        num_workers=0,
        report=lines.append,
    )
    assert lines[0].startswith("Going on with ")


def test_a_dataset_that_does_not_match_its_manifest_is_refused_in_one_line(
    tmp_path: Path, corpus: list[Path], tokenizer: HuggingFaceTokenizer
) -> None:
    out = tmp_path / "out"
    prepare_dataset(out, corpus, tokenizer=tokenizer, num_workers=0)
    with pytest.raises(PreparedDataError, match="another tokenizer") as refused:
        PreparedDataset(out, tokenizer=ByteTokenizer())
    assert "\n" not in str(refused.value)

    tokens = (out / "tokens.bin").read_bytes()
    (out / "tokens.bin").write_bytes(tokens[:-2])
    with pytest.raises(PreparedDataError, match=r"tokens.bin does not match .* truncated") as bad:
        PreparedDataset(out)
    assert f"{len(tokens) - 2} bytes, but the manifest says {len(tokens)}" in str(bad.value)
    assert "\n" not in str(bad.value)

    (out / "tokens.bin").write_bytes(bytes([tokens[0] ^ 1]) + tokens[1:])
    with pytest.raises(PreparedDataError, match=r"tokens.bin does not match .* damaged"):
        PreparedDataset(out).verify()


def test_progress_reports_documents_tokens_a_second_and_the_time_left() -> None:
    lines: list[str] = []
    progress = writer._Progress(
        total_bytes=4e9, done_bytes=1e9, report=lines.append, every_seconds=0.0
    )
    time.sleep(0.01)
    progress.update(1e9, num_documents=1234, num_tokens=5_000_000)
    [line] = lines
    assert line.startswith("1,234 documents, 5,000,000 tokens (")
    assert "tokens/s), 50% of 4.00 GB, 0:00:" in line and line.endswith(" left")
