"""Digests of checkpoint files, taken while the bytes are written or read, never by a re-read.

A checkpoint of format 2 records the xxh3-128 digest of every file. Each rank computes the
digests of the files it writes as it writes them (:class:`HashingStream`), so a commit reads
nothing back. Verification reads each byte once (:func:`digest_file`), and the ranks of a resume
split the files between them (:func:`share_of`). Format 1 (sha256) still verifies.

Why xxh3-128: the digests guard against damage (a torn write, a truncated copy, a flipped bit),
not against an attacker, who could rewrite the manifest too; ``torch.load(weights_only=True)`` is
what stands between a forged file and code execution. Measured on this project's 2-core machine,
xxh3-128 hashes 19.7 GB/s, sha256 1.6 GB/s, blake2b 0.8 GB/s and zlib.crc32 3.7 GB/s, while the
page cache takes writes at about 1.2 GB/s: only xxh3 costs a few percent of a save. 128 bits
make an accidental match of a damaged file impossible in practice (crc32's 32 bits do not).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol, final

from checkpoint.errors import CheckpointError

ALGORITHM: Final = "xxh3_128"
"""The digest of checkpoints written now (manifest format 2)."""

_READ_CHUNK: Final = 1 << 22


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A streaming hasher of ``algorithm`` (``xxh3_128``, or ``sha256`` of format 1)."""
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(
        f"The checkpoint digest algorithm must be 'xxh3_128' or 'sha256', but is {algorithm!r}: "
        "the checkpoint was written by a newer version of this project; upgrade it to load it."
    )


@dataclass(frozen=True)
class FileDigest:
    size: int
    digest: str

    def as_entry(self) -> dict[str, Any]:
        return {"size": self.size, "digest": self.digest}


@final
class HashingStream(io.RawIOBase):
    """A write-only file that hashes every byte on its way to ``raw``; ``on_close`` gets the sum.

    hashlib and xxhash release the GIL on large buffers, so a writer thread hashing here does not
    hold up the training loop.
    """

    def __init__(self, raw: BinaryIO, *, on_close: Callable[[FileDigest], None]) -> None:
        super().__init__()
        self._raw = raw
        self._hasher = new_hasher(ALGORITHM)
        self._size = 0
        self._on_close = on_close
        self._failure: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._raw.write(view)
        except OSError as ex:
            # torch.save's zip writer reports a failed write only as a bad position; close()
            # raises the real cause (a full disk, say) instead.
            self._failure = ex
            raise
        if written != len(view):
            raise OSError(f"Short write: {written} of {len(view)} bytes.")
        self._hasher.update(view)
        self._size += len(view)
        return len(view)

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # flushes
        finally:
            self._raw.close()
        if self._failure is not None:
            raise self._failure
        self._on_close(FileDigest(self._size, self._hasher.hexdigest()))


def write_hashed(data: Any, file: Path) -> FileDigest:
    """Write the bytes of ``data`` to ``file``, fsynced; return the digest of what was written."""
    import os

    digests: list[FileDigest] = []
    with HashingStream(file.open("wb"), on_close=digests.append) as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    return digests[0]


def digest_file(file: Path, algorithm: str) -> FileDigest:
    """Read ``file`` once, front to back, and return its size and digest."""
    hasher = new_hasher(algorithm)
    size = 0
    with file.open("rb", buffering=0) as f:
        buffer = bytearray(_READ_CHUNK)
        view = memoryview(buffer)
        while count := f.readinto(buffer):  # type: ignore[attr-defined]
            hasher.update(view[:count])
            size += count
    return FileDigest(size, hasher.hexdigest())


def share_of(files: Mapping[str, int], *, rank: int, world_size: int) -> list[str]:
    """The files (name -> size) that ``rank`` verifies: the biggest first, each to the least
    loaded rank, so every rank reads about the same number of bytes. Deterministic, so the ranks
    agree on the split without talking."""
    loads = [0] * world_size
    mine: list[str] = []
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        owner = loads.index(min(loads))
        loads[owner] += size
        if owner == rank:
            mine.append(name)
    return mine


def verify_file(file: Path, *, size: int, digest: str, algorithm: str) -> None:
    """Raise CheckpointError unless ``file`` has ``size`` bytes and ``digest``."""
    if not file.is_file():
        raise CheckpointError(f"{file} is missing from the checkpoint.")
    try:
        actual_size = file.stat().st_size
        if actual_size != size:
            raise CheckpointError(
                f"{file} has {actual_size} bytes, but the manifest says {size}: it is "
                "truncated or altered."
            )
        actual = digest_file(file, algorithm)
    except OSError as ex:
        raise CheckpointError(f"{file} cannot be read: {ex}") from ex
    if actual.size != size or actual.digest != digest:
        raise CheckpointError(
            f"{file} does not match its {algorithm} digest: it is damaged, altered, or a file "
            "of another checkpoint."
        )
