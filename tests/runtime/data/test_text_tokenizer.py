"""Tokenizers for text data: a tokenizer.json made here, its EOS/BOS from the config files, bytes."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from runtime.data.text import ByteTokenizer, HuggingFaceTokenizer, load_tokenizer
from tests.conftest import make_tokenizer_dir

TEXTS = ["the cat sat", "on the mat", "the dog ran"]


@pytest.mark.parametrize(
    "config_file", ["tokenizer_config.json", "special_tokens_map.json", "config.json"]
)
def test_eos_and_bos_come_from_the_model_directory(tmp_path: Path, config_file: str) -> None:
    directory = make_tokenizer_dir(tmp_path, TEXTS, config_file=config_file)
    tokenizer = load_tokenizer(directory / "tokenizer.json")

    assert (tokenizer.eos_id, tokenizer.bos_id) == (2, 1)
    ids = tokenizer.encode("the cat ran")
    assert 1 not in ids and 2 not in ids  # encode adds no special tokens
    assert tokenizer.decode(ids) == "the cat ran"
    assert tokenizer.encode_batch(["the mat", "on"]) == [
        tokenizer.encode("the mat"),
        tokenizer.encode("on"),
    ]
    assert tokenizer.vocab_size == 3 + len(set(" ".join(TEXTS).split()))


def test_a_directory_path_loads_its_tokenizer_json_and_pickles_for_workers(tmp_path: Path) -> None:
    tokenizer = HuggingFaceTokenizer(make_tokenizer_dir(tmp_path, TEXTS))
    copy = pickle.loads(pickle.dumps(tokenizer))

    assert copy.encode("the dog sat") == tokenizer.encode("the dog sat")
    assert (copy.eos_id, copy.bos_id, copy.vocab_size) == (2, 1, tokenizer.vocab_size)


def test_explicit_tokens_override_and_unknown_ones_are_named(tmp_path: Path) -> None:
    directory = make_tokenizer_dir(tmp_path, TEXTS, config_file=None)
    tokenizer = HuggingFaceTokenizer(directory, eos_token="<s>")
    assert (tokenizer.eos_id, tokenizer.bos_id) == (1, None)

    with pytest.raises(ValueError, match=r"eos_token '<eot>' .* is not in its vocabulary"):
        HuggingFaceTokenizer(directory, eos_token="<eot>")


def test_a_tokenizer_without_eos_is_a_clear_error(tmp_path: Path) -> None:
    directory = make_tokenizer_dir(tmp_path, TEXTS, config_file=None)
    with pytest.raises(ValueError, match=r"has no EOS token.*Pass eos_token"):
        load_tokenizer(directory)


def test_a_missing_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Cannot load the tokenizer .*tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_without_a_path_the_tokenizer_is_byte_level() -> None:
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.encode("hé") == [104, 195, 169]
    assert tokenizer.decode([256, 104, 195, 169, 257]) == "hé"
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (256, 257, 258)
