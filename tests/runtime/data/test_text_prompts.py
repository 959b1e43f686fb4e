"""GRPO's prompts: text as ``[BOS] prompt``, chat messages through the template with its
generation prompt, the other fields kept, long prompts left out, Parquet, bad records."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.data.text import PromptDataset, TextDataError, collate_prompts, load_tokenizer
from tests.runtime.data.test_text_preference import tokenizer_dir, words, write_jsonl


def test_text_and_chat_prompts_keep_their_other_fields(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path, chat=True))
    chat = [{"role": "user", "content": "the cat"}]
    records = [
        {"prompt": "the cat sat", "answer": "mat"},
        {"prompt": chat, "answer": "dogs", "level": 2},
        {"prompt": "the cat sat on a mat dogs ran far over green hills", "answer": "x"},
    ]
    dataset = PromptDataset(
        write_jsonl(tmp_path / "p.jsonl", records), tokenizer=tokenizer, max_prompt_len=6
    )
    assert len(dataset) == 2 and dataset.num_dropped == 1
    text, messages = dataset[0], dataset[1]
    assert text.prompt_ids[0] == tokenizer.bos_id
    assert words(tokenizer, text.prompt_ids[1:]) == ["the", "cat", "sat"]
    assert messages.prompt == chat
    assert tokenizer.decode(messages.prompt_ids).rstrip().endswith("assistant")
    batch = collate_prompts([text, messages])
    assert batch.prompts == ["the cat sat", chat]
    assert batch.columns == {"answer": ["mat", "dogs"], "level": [None, 2]}


def test_prompts_are_read_from_parquet_and_a_bad_record_is_named(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path))
    table = pa.table({"question": ["the cat", "dogs ran"], "answer": ["sat", "far"]})
    pq.write_table(table, tmp_path / "p.parquet")
    dataset = PromptDataset(
        tmp_path / "p.parquet", tokenizer=tokenizer, max_prompt_len=8, prompt_field="question"
    )
    assert [e.columns for e in (dataset[0], dataset[1])] == [{"answer": "sat"}, {"answer": "far"}]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 3}])
    with pytest.raises(TextDataError, match=r"bad\.jsonl: line 1: the field 'prompt' is int"):
        PromptDataset(bad, tokenizer=tokenizer, max_prompt_len=8)
