"""The data of ``recipes.char_lm``: windows of a byte corpus (by default the running Python's
standard library), or prepared datasets."""

from __future__ import annotations

import logging
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gangs import Gangs
from recipes.char_lm.config import DataSection
from runtime import DataReader, MapDataReader, SyncMode
from runtime.data.text import PreparedDataReader, TextBatch

log = logging.getLogger(__name__)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(config: DataSection) -> tuple[Tensor, Tensor]:
    """Read the text files into a train and a valid byte tensor, split by file deterministically."""
    root = config.data_dir or stdlib_dir()
    if not root.is_dir():
        raise ValueError(f"data.data_dir must be a directory of text files, but is {root}.")
    files = sorted(
        p
        for p in root.rglob("*")
        if p.suffix in (".py", ".txt") and p.is_file() and "site-packages" not in p.parts
    )
    chunks: dict[str, list[bytes]] = {"train": [], "valid": []}
    budget = {"train": config.max_train_bytes, "valid": config.max_valid_bytes}
    for file in files:
        relative = file.relative_to(root).as_posix()
        split = (
            "valid" if zlib.crc32(relative.encode()) % config.valid_every_nth_file == 0 else "train"
        )
        if budget[split] <= 0:
            if all(b <= 0 for b in budget.values()):
                break
            continue
        data = file.read_bytes()[: budget[split]]
        chunks[split].append(data)
        budget[split] -= len(data)
    train, valid = (_bytes_tensor(b"".join(chunks[split])) for split in ("train", "valid"))
    for name, tensor in (("train", train), ("valid", valid)):
        if tensor.numel() < 4 * (config.seq_len + 1):
            raise ValueError(
                f"{root} holds too little {name} text ({tensor.numel()} bytes) for data.seq_len "
                f"{config.seq_len}. Point data.data_dir at more text."
            )
    return train, valid


def _bytes_tensor(data: bytes) -> Tensor:
    # frombuffer rejects an empty buffer; an empty split is reported by the size check instead.
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(torch.utils.data.Dataset[Tensor]):
    """Non-overlapping windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, data: Tensor, seq_len: int) -> None:
        self._data = data
        self._window = seq_len + 1

    def __len__(self) -> int:
        return (self._data.numel() - 1) // self._window

    def __getitem__(self, index: int) -> Tensor:
        start = index * self._window
        return self._data[start : start + self._window].long()


@dataclass
class LMBatch:
    inputs: Tensor
    targets: Tensor

    @property
    def batch_size(self) -> int:
        return self.inputs.size(0)

    @property
    def num_targets(self) -> int:
        return self.targets.numel()


def collate_windows(windows: list[Tensor]) -> LMBatch:
    stacked = torch.stack(windows)
    return LMBatch(inputs=stacked[:, :-1], targets=stacked[:, 1:])


CharBatch = LMBatch | TextBatch


def build_readers(
    config: DataSection, gangs: Gangs, *, seed: int
) -> tuple[DataReader[CharBatch], DataReader[CharBatch] | None, int]:
    """The train and valid readers, and the vocabulary size their tokens need."""
    if config.train is not None:
        train = PreparedDataReader(
            sources=config.train,
            seq_len=config.seq_len,
            batch_size=config.batch_size,
            gang=gangs.dp,
            num_accumulate=config.num_accumulate,
            seed=seed,
        )
        valid = None
        if config.valid is not None:
            valid = PreparedDataReader(
                sources=config.valid,
                seq_len=config.seq_len,
                batch_size=config.batch_size,
                gang=gangs.dp,
            ).for_evaluation()
        return train, valid, train.vocab_size
    train_bytes, valid_bytes = load_corpus(config)
    log.info("Corpus: %d train bytes, %d valid bytes.", train_bytes.numel(), valid_bytes.numel())
    train_windows: DataReader[CharBatch] = MapDataReader(
        dataset=ByteWindows(train_bytes, config.seq_len),
        batch_size=config.batch_size,
        collate=collate_windows,
        gang=gangs.dp,
        num_accumulate=config.num_accumulate,
        seed=seed,
    )
    valid_windows: DataReader[CharBatch] = MapDataReader(
        dataset=ByteWindows(valid_bytes, config.seq_len),
        batch_size=config.batch_size,
        collate=collate_windows,
        gang=gangs.dp,
        shuffle=False,
        drop_remainder=False,
        sync_mode=SyncMode.UNTIL_LAST,
    )
    return train_windows, valid_windows, 256
