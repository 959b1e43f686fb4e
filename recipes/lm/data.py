"""The data of ``recipes.lm``: the tokenizer, and the train and valid readers of each task
(packed text, prepared datasets, SFT examples, preference pairs)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from gangs import Gangs
from recipes.lm.config import LMConfig
from runtime import DataReader, MapDataReader, SyncMode
from runtime.data.sequence import SequenceSplitReader
from runtime.data.text import (
    InstructionDataset,
    InstructionFields,
    PreferenceDataset,
    PreparedDataReader,
    TextBatch,
    TextDataReader,
    TextSource,
    Tokenizer,
    collate_instructions,
    collate_preference_pairs,
    is_prepared_dataset,
    load_tokenizer,
    parse_mixture,
)
from units.preference import PREFERENCE_TASKS


def load_recipe_tokenizer(config: LMConfig) -> Tokenizer:
    path = config.tokenizer.path
    hf_path = config.model.hf_path
    if path is None and hf_path is not None and (hf_path / "tokenizer.json").is_file():
        path = hf_path
    return load_tokenizer(path)


def build_readers(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, preference: PreferenceData | None = None
) -> tuple[DataReader[Any], DataReader[Any] | None]:
    """The train and valid readers; ``preference``: the pairs of a preference task, if read
    already. Under sequence parallelism each keeps this SP rank's part of every sequence."""
    train, valid = _build_readers(config, tokenizer, gangs, preference)
    if gangs.sp.size == 1:
        return train, valid
    return SequenceSplitReader(train, gangs.sp), (
        None if valid is None else SequenceSplitReader(valid, gangs.sp)
    )


def _build_readers(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, preference: PreferenceData | None
) -> tuple[DataReader[Any], DataReader[Any] | None]:
    data, seed = config.data, config.trainer.seed
    if config.task in PREFERENCE_TASKS:
        pairs = preference or preference_data(config, tokenizer)
        return _preference_reader(config, tokenizer, gangs, pairs.train, train=True), (
            _preference_reader(config, tokenizer, gangs, pairs.valid, train=False)
            if pairs.valid is not None
            else None
        )
    if config.task == "sft":
        return _sft_reader(config, tokenizer, gangs, data.train, train=True), (
            _sft_reader(config, tokenizer, gangs, data.valid, train=False) if data.valid else None
        )
    sources = (
        parse_mixture(data.mixture) if data.mixture is not None else [TextSource(str(data.train))]
    )
    # What both readers take; the on-the-fly one also reads and tokenizes the files.
    packing: dict[str, Any] = {
        "tokenizer": tokenizer,
        "seq_len": data.seq_len,
        "batch_size": data.batch_size,
        "gang": gangs.dp,
        "document_ids": data.document_mask,
    }
    train: DataReader[Any]
    if _all_prepared(sources):
        train = PreparedDataReader(
            sources=sources, num_accumulate=data.num_accumulate, seed=seed, **packing
        )
    else:
        train = TextDataReader(
            sources=sources,
            num_accumulate=data.num_accumulate,
            seed=seed,
            num_workers=data.num_workers,
            text_field=data.text_field,
            skip_bad_lines=data.skip_bad_lines,
            **packing,
        )
    if data.valid is None:
        return train, None
    if is_prepared_dataset(data.valid):
        return train, PreparedDataReader(sources=data.valid, **packing).for_evaluation()
    valid = MapDataReader(
        dataset=packed_valid_set(config, tokenizer),
        batch_size=data.batch_size,
        collate=collate_text_batches,
        gang=gangs.dp,
        shuffle=False,
        drop_remainder=False,
        sync_mode=SyncMode.UNTIL_LAST,
    )
    return train, valid


def _all_prepared(sources: list[TextSource]) -> bool:
    """Whether the datasets are prepared directories; refuses a mixture of both kinds."""
    prepared = [is_prepared_dataset(path) for source in sources for path in source.paths]
    if any(prepared) and not all(prepared):
        raise ValueError(
            "data.mixture mixes prepared directories and text files. Prepare every dataset "
            "(python -m runtime prepare), or give text files only."
        )
    return all(prepared)


def packed_valid_set(config: LMConfig, tokenizer: Tokenizer) -> list[TextBatch]:
    """The valid files packed once, in file order, into sequences of one row each: every rank
    holds them all and the reader shards them, so the score covers every full sequence (only
    the tokens after the last one are left out)."""
    data = config.data
    assert data.valid is not None
    reader = TextDataReader(
        sources=data.valid,
        tokenizer=tokenizer,
        seq_len=data.seq_len,
        batch_size=1,
        gang=Gangs.single().dp,
        text_field=data.text_field,
        skip_bad_lines=data.skip_bad_lines,
        document_ids=data.document_mask,
        shuffle_files=False,
    )
    try:
        rows = [batch for batches in reader for batch in batches]
    finally:
        reader.close()
    if not rows:
        raise ValueError(
            f"data.valid ({data.valid}) holds fewer than data.seq_len + 1 ({data.seq_len + 1}) "
            "tokens: not one sequence to validate on."
        )
    return rows


def collate_text_batches(rows: list[TextBatch]) -> TextBatch:
    def cat(name: str) -> Tensor | None:
        parts = [getattr(row, name) for row in rows]
        return None if parts[0] is None else torch.cat(parts)

    input_ids, target_ids = cat("input_ids"), cat("target_ids")
    assert input_ids is not None and target_ids is not None
    return TextBatch(
        input_ids=input_ids,
        target_ids=target_ids,
        num_targets=sum(row.num_targets for row in rows),
        document_ids=cat("document_ids"),
        positions=cat("positions"),
    )


def _sft_reader(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, path: str | None, *, train: bool
) -> DataReader[Any]:
    data = config.data
    assert path is not None
    dataset = InstructionDataset(
        path,
        tokenizer=tokenizer,
        max_len=data.seq_len,
        fields=InstructionFields(
            prompt=data.prompt_field, response=data.response_field, messages=data.messages_field
        ),
        seed=config.trainer.seed,
        bucket_size=data.bucket_size,
        skip_bad_lines=data.skip_bad_lines,
    )
    # The dataset's own order already groups similar lengths; a reader shuffle would undo it.
    return MapDataReader(
        dataset=dataset,
        batch_size=data.batch_size,
        collate=partial(collate_instructions, pad_id=tokenizer.eos_id),
        gang=gangs.dp,
        num_accumulate=data.num_accumulate if train else 1,
        shuffle=False,
        drop_remainder=train,
        sync_mode=SyncMode.UNTIL_FIRST if train else SyncMode.UNTIL_LAST,
    )


@dataclass
class PreferenceData:
    train: PreferenceDataset
    valid: PreferenceDataset | None


def preference_data(config: LMConfig, tokenizer: Tokenizer) -> PreferenceData:
    """The pairs of data.train and data.valid."""
    data = config.data

    def dataset(path: str) -> PreferenceDataset:
        return PreferenceDataset(
            path,
            tokenizer=tokenizer,
            max_len=data.seq_len,
            fields=config.preference.fields,
            seed=config.trainer.seed,
            bucket_size=data.bucket_size,
            skip_bad_lines=data.skip_bad_lines,
        )

    assert data.train is not None
    return PreferenceData(dataset(data.train), dataset(data.valid) if data.valid else None)


def _preference_reader(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, dataset: PreferenceDataset, *, train: bool
) -> DataReader[Any]:
    data = config.data
    collate = partial(
        collate_preference_pairs,
        pad_id=tokenizer.eos_id,
        num_bad_lines=dataset.num_bad_lines,
        num_dropped=dataset.num_dropped,
    )
    # As _sft_reader: the dataset's order groups similar lengths; the valid set is read whole,
    # every pair once, whatever the number of ranks.
    return MapDataReader(
        dataset=dataset,
        batch_size=data.batch_size,
        collate=collate,
        gang=gangs.dp,
        num_accumulate=data.num_accumulate if train else 1,
        shuffle=False,
        drop_remainder=train,
        sync_mode=SyncMode.UNTIL_FIRST if train else SyncMode.UNTIL_LAST,
    )
