"""Preference pairs: tokens and targets, chat messages, truncation, bad records, Parquet."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from runtime.data.text import (
    IGNORE_INDEX,
    HuggingFaceTokenizer,
    PreferenceDataset,
    PreferenceFields,
    TextDataError,
    collate_preference_pairs,
    load_tokenizer,
)
from runtime.data.text.tokenizer import Tokenizer
from tests.conftest import make_tokenizer_dir

TEXTS = ["the cat sat on a mat", "dogs ran far over green hills", "user assistant"]


def tokenizer_dir(tmp_path: Path, *, chat: bool = False) -> Path:
    directory = make_tokenizer_dir(tmp_path / "tok", TEXTS)
    if chat:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = (
            "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
        )
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def words(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    return tokenizer.decode(ids).split()


def test_a_batch_holds_the_chosen_rows_then_the_rejected_with_targets_on_completions(
    tmp_path: Path,
) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path))
    data = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "the cat", "chosen": "sat on a mat", "rejected": "ran"},
            {"prompt": "dogs", "chosen": "ran far", "rejected": "sat on green hills"},
        ],
    )
    dataset = PreferenceDataset(data, tokenizer=tokenizer, max_len=32, bucket_size=1)
    pairs = sorted((dataset[i] for i in range(len(dataset))), key=lambda p: len(p.prompt))
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    assert pairs[0].prompt == [bos, *tokenizer.encode("dogs")]
    assert pairs[0].chosen == [*tokenizer.encode("ran far"), eos]

    batch = collate_preference_pairs(pairs, pad_id=eos)
    assert batch.num_pairs == 2 and batch.input_ids.shape == (4, 1 + 2 + 4 + 1)
    for row, (pair, completion) in enumerate(
        [(pair, pair.chosen) for pair in pairs] + [(pair, pair.rejected) for pair in pairs]
    ):
        ids = pair.prompt + completion
        assert batch.input_ids[row, : len(ids)].tolist() == ids
        assert (batch.input_ids[row, len(ids) :] == eos).all()
        targets = batch.target_ids[row].tolist()
        # Position p predicts token p + 1: the targets are the completion, nothing else.
        assert [t for t in targets if t != IGNORE_INDEX] == completion
        assert targets[len(pair.prompt) - 1 : len(ids) - 1] == completion


def test_chat_pairs_are_rendered_with_the_tokenizer_template(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path, chat=True))
    prompt = [{"role": "user", "content": "the cat"}]
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "sat on a mat"}],
        "rejected": "ran",  # a string is one assistant message
    }
    data = write_jsonl(tmp_path / "chat.jsonl", [record])
    pair = PreferenceDataset(data, tokenizer=tokenizer, max_len=32)[0]
    assert pair.prompt[0] == tokenizer.bos_id
    assert words(tokenizer, pair.prompt[1:]) == ["user", "the", "cat", "assistant"]
    # The template ends the turn: no EOS is added, as TRL adds none to chat completions.
    assert words(tokenizer, pair.chosen) == ["assistant", "sat", "on", "a", "mat"][1:]
    assert words(tokenizer, pair.rejected) == ["ran"]


def test_chat_pairs_without_a_template_are_refused_with_the_fix(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path))
    record = {"prompt": [{"role": "user", "content": "the"}], "chosen": "a", "rejected": "b"}
    data = write_jsonl(tmp_path / "chat.jsonl", [record])
    with pytest.raises(TextDataError, match="needs the tokenizer's chat template"):
        PreferenceDataset(data, tokenizer=tokenizer, max_len=32)


def test_truncation_keeps_the_start_and_counts_cut_and_left_out_pairs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path))
    data = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "the cat", "chosen": "sat", "rejected": "ran"},  # fits: 1 + 2 + 2
            {"prompt": "the cat", "chosen": "sat on a mat", "rejected": "ran"},  # cut
            {"prompt": "the cat sat on", "chosen": "a", "rejected": "mat"},  # prompt fills 5
        ],
    )
    with caplog.at_level(logging.WARNING):
        dataset = PreferenceDataset(data, tokenizer=tokenizer, max_len=5)
    assert (len(dataset), dataset.num_truncated, dataset.num_dropped) == (2, 1, 1)
    assert "1 of the 3 pairs" in caplog.text and "1 pairs of" in caplog.text
    # The cut completion lost its end, EOS included.
    (cut,) = (dataset[i] for i in range(2) if dataset[i].chosen[-1] != tokenizer.eos_id)
    assert len(cut.prompt) + len(cut.chosen) == 5
    assert words(tokenizer, cut.chosen) == ["sat", "on"]
    batch = collate_preference_pairs([dataset[0]], pad_id=2, num_dropped=dataset.num_dropped)
    assert batch.num_dropped == 1


def test_a_file_with_no_pair_that_fits_says_so(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path))
    data = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "the cat sat", "chosen": "a", "rejected": "b"}]
    )
    with pytest.raises(TextDataError, match=r"no preference pair .* shorter than 3 tokens"):
        PreferenceDataset(data, tokenizer=tokenizer, max_len=3)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "line 2: the line is not JSON"),
        ('{"prompt": "a", "chosen": "b"}', r"line 2: the record has no field 'rejected'"),
        ('{"prompt": "a", "chosen": 3, "rejected": "b"}', "line 2: the field 'chosen' is int"),
        ('["a", "b"]', "line 2: the record is a list"),
    ],
)
def test_a_bad_record_names_its_line_or_is_skipped_and_counted(
    tmp_path: Path, line: str, problem: str
) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path))
    data = tmp_path / "pairs.jsonl"
    good = json.dumps({"prompt": "the", "chosen": "cat", "rejected": "dogs"})
    data.write_text(f"{good}\n{line}\n{good}\n")
    with pytest.raises(TextDataError, match=f"pairs.jsonl: {problem}"):
        PreferenceDataset(data, tokenizer=tokenizer, max_len=16)
    dataset = PreferenceDataset(data, tokenizer=tokenizer, max_len=16, skip_bad_lines=True)
    assert (len(dataset), dataset.num_bad_lines) == (2, 1)


def test_pairs_are_read_from_parquet_under_other_field_names(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path))
    table = pa.table({"q": ["the cat", "dogs"], "good": ["sat", "ran far"], "bad": ["ran", "a"]})
    pq.write_table(table, tmp_path / "pairs.parquet", row_group_size=1)
    fields = PreferenceFields(prompt="q", chosen="good", rejected="bad")
    dataset = PreferenceDataset(
        tmp_path / "pairs.parquet", tokenizer=tokenizer, max_len=16, fields=fields
    )
    chosen = sorted(words(tokenizer, dataset[i].chosen[:-1]) for i in range(len(dataset)))
    assert chosen == [["ran", "far"], ["sat"]]


def test_an_empty_prompt_without_a_bos_is_refused(tmp_path: Path) -> None:
    directory = make_tokenizer_dir(tmp_path / "tok", TEXTS, config_file=None)
    tokenizer = HuggingFaceTokenizer(directory, eos_token="</s>")
    assert tokenizer.bos_id is None
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "", "chosen": "a", "rejected": "b"}])
    with pytest.raises(TextDataError, match="line 1: the prompt has no token"):
        PreferenceDataset(data, tokenizer=tokenizer, max_len=16)
