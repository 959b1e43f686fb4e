"""TextDataReader: data files, packing, mixtures, exact resume, and its worker processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gangs import FakeGang
from runtime.data.text import (
    ByteTokenizer,
    TextBatch,
    TextDataError,
    TextDataReader,
    TextSource,
    load_tokenizer,
    parse_mixture,
)
from tests.conftest import (
    REPO_ROOT,
    assert_ok,
    child_env,
    make_tokenizer_dir,
    rank_reports,
    torchrun,
)

BYTES = ByteTokenizer()
BOS, EOS = BYTES.bos_id, BYTES.eos_id


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text(
        "".join(json.dumps({field: text, "id": nr}) + "\n" for nr, text in enumerate(texts))
    )
    return path


def docs(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{nr}-" + prefix * (nr % 13) for nr in range(count)]


def reader(sources: Any, **kwargs: Any) -> TextDataReader:
    options: dict[str, Any] = {
        "tokenizer": BYTES,
        "seq_len": 16,
        "batch_size": 2,
        "gang": FakeGang(),
    }
    return TextDataReader(sources=sources, **(options | kwargs))


def rows(steps: list[list[TextBatch]]) -> list[list[int]]:
    """The input rows of every micro-batch of every step, in order."""
    return [row for step in steps for batch in step for row in batch.input_ids.tolist()]


def read_all(data_reader: TextDataReader) -> list[list[TextBatch]]:
    steps = list(data_reader)
    data_reader.close()
    return steps


def stream_of(texts: list[str]) -> list[int]:
    return [token for text in texts for token in [BOS, *BYTES.encode(text), EOS]]


# ----------------------------------------------------------------------------- files and packing


def test_sequences_are_the_document_stream_cut_into_seq_len_plus_one(tmp_path: Path) -> None:
    texts = docs("a", 40)
    steps = read_all(reader(str(write_jsonl(tmp_path / "a.jsonl", texts)), chunk_bytes=64))
    stream = stream_of(texts)
    expected = [stream[start : start + 17] for start in range(0, len(stream) - 16, 17)]
    expected = expected[: len(expected) // 2 * 2]  # whole steps of 2 sequences only

    batches = [batch for step in steps for batch in step]
    assert [row for b in batches for row in b.input_ids.tolist()] == [s[:-1] for s in expected]
    assert [row for b in batches for row in b.target_ids.tolist()] == [s[1:] for s in expected]
    assert all(b.num_targets == 2 * 16 and b.input_ids.dtype == torch.int64 for b in batches)


def test_document_ids_and_positions_restart_at_each_document(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ["abc", "defghij", "k" * 30])
    batch = next(reader(str(path), seq_len=10, batch_size=1, document_ids=True))[0]

    # [BOS a b c EOS] [BOS d e f g h] | i j EOS ...: 11 tokens, inputs are the first 10.
    assert batch.document_ids is not None and batch.positions is not None
    assert batch.document_ids.tolist() == [[0] * 5 + [1] * 5]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]


def test_text_and_parquet_files_and_globs_are_read_by_extension(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("line one\n\nline two\r\n")
    pq.write_table(
        pa.table({"body": ["row one", "row two"]}), tmp_path / "c.parquet", row_group_size=1
    )
    write_jsonl(tmp_path / "a.jsonl", ["json one"], field="body")
    texts = ["json one", "line one", "line two", "row one", "row two"]

    data_reader = reader(
        str(tmp_path / "*"), text_field="body", shuffle_files=False, seq_len=4, batch_size=1
    )
    stream = stream_of(texts)
    starts = range(0, len(stream) - 4, 5)
    assert rows(read_all(data_reader)) == [stream[start : start + 4] for start in starts]


def test_a_hugging_face_tokenizer_packs_its_ids_between_bos_and_eos(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(make_tokenizer_dir(tmp_path / "tok", ["the cat sat on the mat"]))
    path = write_jsonl(tmp_path / "a.jsonl", ["the cat", "sat on the mat"])
    batch = next(reader(str(path), tokenizer=tokenizer, seq_len=8, batch_size=1))[0]

    ids = [1, *tokenizer.encode("the cat"), 2, 1, *tokenizer.encode("sat on the mat"), 2]
    assert batch.input_ids.tolist() == [ids[:8]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"a\.jsonl: line 3: the line is not JSON"),
        (
            '{"body": "x"}',
            r"a\.jsonl: line 3: the record has no field 'text' \(it has \['body'\]\)",
        ),
        ('{"text": 7}', r"a\.jsonl: line 3: the field 'text' is int, not a string"),
    ],
)
def test_a_bad_line_is_an_error_naming_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n' + line + '\n{"text": "four"}\n')
    with pytest.raises(TextDataError, match=message + r".*set skip_bad_lines"):
        list(reader(str(path), seq_len=2, batch_size=1))


def test_skip_bad_lines_counts_them_and_reads_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "one"}\n{oops\n{"x": 1}\n\xff\xfe\n{"text": "two"}\n')
    data_reader = reader(str(path), seq_len=3, batch_size=1, skip_bad_lines=True)
    tokens = [token for row in rows(read_all(data_reader)) for token in row]

    assert data_reader.num_bad_lines == 3
    assert tokens == stream_of(["one", "two"])[:8][:3] + stream_of(["one", "two"])[4:7]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing.jsonl", "does not exist"),
        ("*.json", "matches no data file"),
        ("*.csv", "extension '.csv', which is not a text data format"),
        ("data.csv", "extension '.csv', which is not a text data format"),
    ],
)
def test_bad_paths_are_named(tmp_path: Path, path: str, message: str) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(TextDataError, match=message):
        reader(str(tmp_path / path))


def test_a_dataset_without_text_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(TextDataError, match="has no documents with text"):
        next(reader(str(tmp_path / "empty.txt")))


# ----------------------------------------------------------------------------- epochs and mixtures


def test_an_epoch_is_one_pass_and_the_next_reshuffles_the_files(tmp_path: Path) -> None:
    for name in "abcdef":
        write_jsonl(tmp_path / f"{name}.jsonl", docs(name, 5))
    data_reader = reader(str(tmp_path / "*.jsonl"), seq_len=8, batch_size=1)
    first = rows(list(data_reader))
    with pytest.raises(StopIteration):
        next(data_reader)
    data_reader.reset()
    second = rows(list(data_reader))

    total = len(stream_of([text for name in "abcdef" for text in docs(name, 5)]))
    assert len(first) == len(second) == total // 9
    assert first != second


def test_mixture_token_ratios_follow_the_weights_after_packing(tmp_path: Path) -> None:
    # Short documents in one dataset, long ones in the other: the weights count tokens.
    write_jsonl(tmp_path / "a.jsonl", ["a" * 3] * 2000)
    write_jsonl(tmp_path / "b.jsonl", ["b" * 200] * 40)
    sources = parse_mixture(
        [{"path": str(tmp_path / "a.jsonl"), "weight": 3}, {"path": str(tmp_path / "b.jsonl")}]
    )
    data_reader = reader(sources, seq_len=31, batch_size=4, seed=5)
    sequences = rows([next(data_reader) for _ in range(150)])

    # A sequence is all from one dataset and every sequence is full, so shares of sequences
    # are shares of tokens; a draw per document would give the short documents far more.
    from_a = [ord("a") in row for row in sequences]
    assert all((ord("b") in row) != a for row, a in zip(sequences, from_a, strict=True))
    assert 0.69 < sum(from_a) / len(sequences) < 0.81


def test_a_mixture_epoch_ends_once_every_dataset_was_read_through(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ["a" * 30] * 50)  # 1600 tokens
    write_jsonl(tmp_path / "b.jsonl", ["b" * 30] * 5)  # 160 tokens, weighted up
    sources = [TextSource(str(tmp_path / "a.jsonl"), 1), TextSource(str(tmp_path / "b.jsonl"), 1)]
    sequences = rows(read_all(reader(sources, seq_len=15, batch_size=2)))

    # a (1600 tokens, 16 a sequence) was read once, up to the step its end left unfilled; b
    # was read again and again, for about as many sequences.
    from_a = sum(ord("a") in row for row in sequences)
    assert 99 <= from_a <= 100
    assert 70 < len(sequences) - from_a < 130


def test_bad_mixtures_are_named() -> None:
    with pytest.raises(ValueError, match="needs a 'path'"):
        parse_mixture([{"weight": 1}])
    with pytest.raises(ValueError, match=r"must be greater than zero, but is -1\.0"):
        parse_mixture([{"path": "a.jsonl", "weight": -1}])


# ----------------------------------------------------------------------------- exact resume


def mixture(tmp_path: Path) -> list[TextSource]:
    for name in "ab":
        write_jsonl(tmp_path / f"{name}1.jsonl", docs(name, 60))
        write_jsonl(tmp_path / f"{name}2.jsonl", docs(name.upper(), 60))
    return [
        TextSource(str(tmp_path / "a*.jsonl"), 2.0),
        TextSource(str(tmp_path / "b*.jsonl"), 1.0),
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_saved_position_resumes_the_identical_steps(tmp_path: Path, num_workers: int) -> None:
    options: dict[str, Any] = {"chunk_bytes": 200, "num_accumulate": 2, "document_ids": True}
    first = reader(mixture(tmp_path), num_workers=num_workers, **options)
    for _ in range(7):
        next(first)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    rest = read_all(first)

    resumed = reader(mixture(tmp_path), num_workers=num_workers, **options)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    again = read_all(resumed)

    assert len(rest) > 10
    assert rows(again) == rows(rest)
    assert [b.document_ids.tolist() for s in again for b in s] == [  # type: ignore[union-attr]
        b.document_ids.tolist()
        for s in rest
        for b in s  # type: ignore[union-attr]
    ]


def test_workers_give_the_same_stream_as_reading_inline(tmp_path: Path) -> None:
    inline = rows(read_all(reader(mixture(tmp_path), chunk_bytes=300)))
    assert rows(read_all(reader(mixture(tmp_path), chunk_bytes=300, num_workers=3))) == inline


def test_a_position_of_other_data_is_refused(tmp_path: Path) -> None:
    state = reader(mixture(tmp_path)).state_dict()
    with pytest.raises(ValueError, match=r"seed 0 \(now 1\).*same datasets, files, seed"):
        reader(mixture(tmp_path), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"num_sources 2 \(now 1\)"):
        reader(str(tmp_path / "a1.jsonl")).load_state_dict(state)


def test_a_position_at_the_epoch_end_stays_there(tmp_path: Path) -> None:
    data_reader = reader(str(write_jsonl(tmp_path / "a.jsonl", docs("a", 10))))
    read_all(data_reader)
    resumed = reader(str(tmp_path / "a.jsonl"))
    resumed.load_state_dict(data_reader.state_dict())
    with pytest.raises(StopIteration):
        next(resumed)
    resumed.reset()
    assert rows(read_all(resumed)) == rows(read_all(_epoch_one(tmp_path / "a.jsonl")))


def _epoch_one(path: Path) -> TextDataReader:
    data_reader = reader(str(path))
    read_all(data_reader)
    data_reader.reset()
    return data_reader


# ----------------------------------------------------------------------------- worker processes


def test_workers_report_bad_lines_naming_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", docs("a", 30))
    with path.open("a") as stream:
        stream.write("not json\n")
    with pytest.raises(TextDataError, match=r"a\.jsonl: line 31: the line is not JSON"):
        list(reader(str(path), num_workers=2, chunk_bytes=100))


def test_close_stops_the_workers_and_reading_again_starts_new_ones(tmp_path: Path) -> None:
    data_reader = reader(mixture(tmp_path), num_workers=2)
    expected = rows([next(data_reader) for _ in range(6)])
    workers = data_reader._chunk_reader.processes  # type: ignore[union-attr]
    assert all(worker.is_alive() for worker in workers)

    data_reader.close()
    assert not any(worker.is_alive() for worker in workers)
    after_close = rows([next(data_reader) for _ in range(2)])
    data_reader.close()

    fresh = reader(mixture(tmp_path))
    assert rows([next(fresh) for _ in range(8)]) == expected + after_close


ORPHAN_SCRIPT = """
import sys, time
from gangs import FakeGang
from runtime.data.text import ByteTokenizer, TextDataReader

if __name__ == "__main__":
    reader = TextDataReader(sources=sys.argv[1], tokenizer=ByteTokenizer(), seq_len=8,
                            batch_size=1, gang=FakeGang(), num_workers=2)
    next(reader)
    print(" ".join(str(p.pid) for p in reader._chunk_reader.processes), flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_the_training_process_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(ORPHAN_SCRIPT)
    path = write_jsonl(tmp_path / "a.jsonl", docs("a", 50))
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(path)],
        env=child_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert trainer.stdout is not None
    pids = [int(pid) for pid in trainer.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)

    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A dead child of the killed trainer is re-parented and reaped; a zombie counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------- data parallelism


@pytest.mark.distributed
def test_ranks_stride_over_one_stream_and_a_position_reshards_to_one_rank(
    tmp_path: Path,
) -> None:
    sources = mixture(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    result = torchrun(
        2, str(Path(__file__).with_name("text_reader_worker.py")), str(tmp_path), str(out)
    )
    assert_ok(result)
    reports = rank_reports(out, 2)

    options: dict[str, Any] = {"seq_len": 12, "chunk_bytes": 256}
    one_rank = rows(read_all(reader(sources, batch_size=1, **options)))
    # A step of 2 ranks x 2 micro-batches x 2 sequences takes 8 sequences of the stream; rank r
    # takes every other one from r, in order.
    for rank, report in enumerate(reports):
        taken = [row for step in report["rows"] for row in step]
        assert taken == one_rank[rank : 3 * 8 : 2]
    assert reports[0]["state"] == reports[1]["state"]

    resumed = reader(sources, batch_size=1, **options)
    resumed.load_state_dict(reports[0]["state"])
    assert rows(read_all(resumed)) == one_rank[3 * 8 :]
