"""A prepared text dataset on disk, and opening one only when its files match its manifest.

A prepared dataset is a directory::

    manifest.json   written last: a directory without it is unfinished and never read
    tokens.bin      every document's tokens, ``[BOS] text [EOS]``, one after another
                    (little-endian; uint16 for vocabularies of up to 65,536 ids, else int32)
    documents.bin   little-endian int64: where each document ends, in tokens

The manifest records the tokenizer's fingerprint, the source files (path, size, digest), the
counts, each file's size and digest, and the format's version. The dataset's *fingerprint*
digests what decides its tokens (the tokenizer and the two files), not where the sources lay.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, final

import numpy as np

from runtime.data.text.files import TextDataError
from runtime.data.text.tokenizer import Tokenizer
from trainkit_utils.files import write_json_durably

FORMAT_NAME: Final = "trainkit-prepared-text"
FORMAT_VERSION: Final = 1
MANIFEST_FILE: Final = "manifest.json"
TOKENS_FILE: Final = "tokens.bin"
DOCUMENTS_FILE: Final = "documents.bin"
WORK_DIR: Final = ".prepare"
"""Where an unfinished preparation keeps its plan and finished chunks, inside the directory."""

_READ_BLOCK = 16 << 20


class PreparedDataError(TextDataError):
    """A prepared dataset that is unfinished, damaged, or made for another tokenizer."""


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The smallest little-endian dtype that holds every id of the vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def stored_dtype(name: str) -> np.dtype[Any]:
    """The dtype a manifest names (``uint16`` or ``int32``), little-endian as on disk."""
    if name not in ("uint16", "int32"):
        raise PreparedDataError(f"The manifest names the token dtype {name!r}: prepare it again.")
    return np.dtype(name).newbyteorder("<")


def file_digest(path: Path) -> str:
    """The xxh3-128 digest of the file's bytes, read in blocks."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while block := file.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def dataset_fingerprint(manifest: Mapping[str, Any]) -> str:
    """The digest of what decides the dataset's tokens, from its manifest."""
    import xxhash

    decisive = {
        "tokenizer": manifest["tokenizer"]["fingerprint"],
        "dtype": manifest["dtype"],
        "add_bos": manifest["add_bos"],
        "files": {name: entry["digest"] for name, entry in manifest["files"].items()},
    }
    return xxhash.xxh3_128_hexdigest(json.dumps(decisive, sort_keys=True).encode())


def write_manifest(
    directory: Path,
    plan: Mapping[str, Any],
    *,
    num_tokens: int,
    num_documents: int,
    num_bad_lines: int,
    files: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """Write the manifest of the dataset in ``directory``, whose files are on disk already:
    ``plan`` (sources, tokenizer, options and dtype), the counts, and each file's size and
    digest. Returns it."""
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        **plan,
        "num_tokens": num_tokens,
        "num_documents": num_documents,
        "num_bad_lines": num_bad_lines,
        "files": {name: dict(entry) for name, entry in files.items()},
    }
    manifest["fingerprint"] = dataset_fingerprint(manifest)
    write_json_durably(manifest, directory / MANIFEST_FILE)
    return manifest


def tokenizer_entry(tokenizer: Tokenizer) -> dict[str, Any]:
    """How a manifest records the tokenizer."""
    return {
        "fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
    }


def is_prepared_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a prepared dataset's directory, finished or not."""
    path = Path(path)
    return (path / MANIFEST_FILE).is_file() or (path / WORK_DIR).is_dir()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the prepared dataset at ``path``; refuses an unfinished or foreign one."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        if (path / WORK_DIR).is_dir():
            raise PreparedDataError(
                f"The prepared dataset {path} is unfinished (its preparation stopped before "
                "the end). Run the same `python -m runtime prepare` command again to finish it."
            )
        raise PreparedDataError(
            f"{path} is not a prepared dataset: it has no {MANIFEST_FILE}. Make one with "
            "`python -m runtime prepare`."
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as ex:
        raise PreparedDataError(f"Cannot read {manifest_path}: {ex}. Prepare it again.") from ex
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise PreparedDataError(f"{manifest_path} is not the manifest of a prepared dataset.")
    if manifest.get("version") != FORMAT_VERSION:
        raise PreparedDataError(
            f"{manifest_path} has format version {manifest.get('version')}, but this version of "
            f"the project reads version {FORMAT_VERSION}. Prepare the dataset again."
        )
    return manifest


@final
class PreparedDataset:
    """A prepared dataset, its files memory-mapped: opening reads only the manifest.

    Opening checks each file's size against the manifest, and, with ``tokenizer``, that the
    dataset was made with that tokenizer; :meth:`verify` also checks every byte (it reads the
    whole dataset). Either refuses with one line that names the file and what differs.
    """

    def __init__(self, path: str | Path, *, tokenizer: Tokenizer | None = None) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._check_sizes()
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)
        dtype = stored_dtype(self.manifest["dtype"])
        self.tokens: np.ndarray[Any, Any] = np.memmap(
            self.path / TOKENS_FILE, dtype=dtype, mode="r", shape=(self.num_tokens,)
        )
        self.document_ends: np.ndarray[Any, Any] = np.memmap(
            self.path / DOCUMENTS_FILE, dtype="<i8", mode="r", shape=(self.num_documents,)
        )

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.manifest["num_documents"])

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    @property
    def tokenizer_fingerprint(self) -> str:
        return str(self.manifest["tokenizer"]["fingerprint"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Refuse a tokenizer other than the one that made the dataset."""
        if tokenizer.fingerprint != self.tokenizer_fingerprint:
            recorded = self.manifest["tokenizer"]
            raise PreparedDataError(
                f"The prepared dataset {self.path} was tokenized by another tokenizer (vocabulary "
                f"{recorded['vocab_size']}, fingerprint {recorded['fingerprint'][:12]}) than this "
                f"run's (vocabulary {tokenizer.vocab_size}, fingerprint "
                f"{tokenizer.fingerprint[:12]}). Use the tokenizer it was prepared with, or "
                "prepare the data again with this one."
            )

    def verify(self) -> None:
        """Check every byte of the token and document files against the manifest's digests."""
        for name, entry in self.manifest["files"].items():
            if file_digest(self.path / name) != entry["digest"]:
                raise PreparedDataError(
                    f"{self.path / name} does not match the manifest of {self.path}: its bytes "
                    "differ from those prepared (a damaged or replaced file). Prepare it again."
                )

    def _check_sizes(self) -> None:
        itemsize = stored_dtype(self.manifest["dtype"]).itemsize
        expected = {
            TOKENS_FILE: self.num_tokens * itemsize,
            DOCUMENTS_FILE: self.num_documents * 8,
        }
        for name, size in expected.items():
            file = self.path / name
            try:
                actual = os.path.getsize(file)
            except OSError:
                raise PreparedDataError(
                    f"{file} is missing, but the manifest of {self.path} lists it. Prepare the "
                    "dataset again."
                ) from None
            if actual != size or self.manifest["files"][name]["size"] != size:
                raise PreparedDataError(
                    f"{file} does not match the manifest of {self.path}: it has {actual} bytes, "
                    f"but the manifest says {size} (a truncated or replaced file). Prepare the "
                    "dataset again."
                )
