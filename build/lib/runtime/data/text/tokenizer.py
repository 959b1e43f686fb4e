"""Tokenizers for text data: a small ABC, a Hugging Face ``tokenizer.json`` one, and bytes."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, final

from typing_extensions import override


class Tokenizer(ABC):
    """Turns text into token ids and back; picklable, so worker processes can use it.

    :meth:`encode` adds no special tokens: the packer puts BOS and EOS around each document.
    """

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text; implementations may encode them together, faster."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """The id that ends a document."""

    @property
    @abstractmethod
    def bos_id(self) -> int | None:
        """The id that begins a document, or None if the tokenizer has none."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The number of ids, special tokens included: the model's embedding size at least."""

    @property
    def fingerprint(self) -> str:
        """A digest that differs between tokenizers that give other ids: prepared datasets
        record it, and refuse a run whose tokenizer has another.

        The default digests the class, the sizes and special ids, and the ids of a probe text
        of many scripts; a subclass with a vocabulary file should digest that instead.
        """
        import xxhash

        ids = self.encode(_PROBE_TEXT)
        described = (type(self).__qualname__, self.vocab_size, self.eos_id, self.bos_id, ids)
        return xxhash.xxh3_128_hexdigest(json.dumps(described).encode())


# Words, digits, punctuation, whitespace and several scripts: two tokenizers that split it
# alike and share their special ids are, for practical purposes, the same.
_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{}\t\n"
    "  def main():\n    return 42  # Grüße, naïve café; Ελληνικά; Русский; 中文; 日本語; 한국어; 🙂"
)


@final
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0 to 255, then BOS (256) and EOS (257)."""

    @override
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @override
    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    @override
    def eos_id(self) -> int:
        return 257

    @property
    @override
    def bos_id(self) -> int | None:
        return 256

    @property
    @override
    def vocab_size(self) -> int:
        return 258

    @property
    @override
    def fingerprint(self) -> str:
        return "bytes-258"


# Where Hugging Face model directories name their special tokens, first found wins.
_TOKEN_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@final
class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizer.json`` of the Hugging Face ``tokenizers`` library.

    EOS and BOS are ``eos_token``/``bos_token`` when given, otherwise those named by the
    neighbouring ``tokenizer_config.json`` or ``special_tokens_map.json``, otherwise the
    ``eos_token_id``/``bos_token_id`` of the neighbouring ``config.json``. A tokenizer without an
    EOS is an error (documents could not be separated); one without a BOS has ``bos_id`` None.
    """

    def __init__(
        self, path: Path | str, *, eos_token: str | None = None, bos_token: str | None = None
    ) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            self._tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as ex:
            raise ValueError(
                f"Cannot load the tokenizer {path}: {ex}. Give tokenizer.path as a "
                "tokenizer.json file of the Hugging Face tokenizers library, or the directory "
                "that holds one."
            ) from ex
        self._path = path
        configured = _configured_ids(path.parent)
        eos = self._token_id("eos_token", eos_token) if eos_token else configured.get("eos")
        if eos is None:
            raise ValueError(
                f"The tokenizer {path} has no EOS token: none is given and neither "
                "tokenizer_config.json, special_tokens_map.json nor config.json beside it names "
                "one. Pass eos_token (for instance '</s>') naming a token of its vocabulary."
            )
        self._eos_id = eos
        self._bos_id = (
            self._token_id("bos_token", bos_token) if bos_token else configured.get("bos")
        )

    def _token_id(self, what: str, token: str | int) -> int:
        if isinstance(token, int):
            return token
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"The {what} {token!r} of the tokenizer {self._path} is not in its vocabulary. "
                f"Name a token of its vocabulary as {what}."
            )
        return token_id

    @property
    def path(self) -> Path:
        """The ``tokenizer.json`` file."""
        return self._path

    @override
    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    @override
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The library encodes a batch on its own threads, outside the GIL.
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [list(encoding.ids) for encoding in encodings]

    @override
    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    @override
    def eos_id(self) -> int:
        return self._eos_id

    @property
    @override
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    @override
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    @override
    def fingerprint(self) -> str:
        # The whole serialized tokenizer (vocabulary, merges, normalizer, added tokens) and
        # the special ids this project adds around documents.
        import xxhash

        digest = xxhash.xxh3_128(self._tokenizer.to_str().encode())
        digest.update(json.dumps([self._eos_id, self._bos_id]).encode())
        return digest.hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "json": self._tokenizer.to_str(),
            "path": self._path,
            "eos": self._eos_id,
            "bos": self._bos_id,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self._tokenizer = _HFTokenizer.from_str(state["json"])
        self._path = state["path"]
        self._eos_id = state["eos"]
        self._bos_id = state["bos"]


def _configured_ids(directory: Path) -> dict[str, int]:
    """The EOS and BOS ids the model directory's config files name, by ``eos``/``bos``."""
    from tokenizers import Tokenizer as _HFTokenizer

    found: dict[str, int] = {}
    vocabulary: _HFTokenizer | None = None
    for name in _TOKEN_CONFIG_FILES:
        config = _read_json(directory / name)
        for key in ("eos", "bos"):
            token = config.get(f"{key}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if key in found or not isinstance(token, str):
                continue
            if vocabulary is None:
                vocabulary = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
            token_id = vocabulary.token_to_id(token)
            if token_id is None:
                raise ValueError(
                    f"{directory / name} names the {key}_token {token!r}, which is not in the "
                    f"vocabulary of {directory / 'tokenizer.json'}. Fix the file, or pass "
                    f"{key}_token naming a token of the vocabulary."
                )
            found[key] = token_id
    model_config = _read_json(directory / "config.json")
    for key in ("eos", "bos"):
        token_id = model_config.get(f"{key}_token_id")
        if isinstance(token_id, list) and token_id:
            token_id = token_id[0]
        if key not in found and isinstance(token_id, int):
            found[key] = token_id
    return found


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as ex:
        raise ValueError(f"Cannot read {path}: {ex}. Fix or remove the file.") from ex
    return value if isinstance(value, dict) else {}


def load_tokenizer(path: Path | str | None) -> Tokenizer:
    """The Hugging Face tokenizer at ``path`` (a ``tokenizer.json`` or its directory), or bytes."""
    if path is None or str(path) == "":
        return ByteTokenizer()
    return HuggingFaceTokenizer(path)
