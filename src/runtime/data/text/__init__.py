"""Text data for language models: tokenizers, data files, packing, mixtures, and their reader."""

from __future__ import annotations

from runtime.data.text.files import FORMATS, TextDataError, find_files
from runtime.data.text.instructions import (
    InstructionBatch,
    InstructionDataset,
    InstructionFields,
    collate_instructions,
)
from runtime.data.text.mixture import MixtureSampler, TextSource, parse_mixture
from runtime.data.text.packing import TextBatch
from runtime.data.text.preference import (
    PreferenceBatch,
    PreferenceDataset,
    PreferenceFields,
    PreferencePair,
    collate_preference_pairs,
)
from runtime.data.text.prepared import (
    PreparedDataError,
    PreparedDataReader,
    PreparedDataset,
    is_prepared_dataset,
    prepare_dataset,
)
from runtime.data.text.prompts import PromptBatch, PromptDataset, PromptExample, collate_prompts
from runtime.data.text.text_reader import TextDataReader
from runtime.data.text.tokenizer import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    load_tokenizer,
)
from units.lm import IGNORE_INDEX

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "InstructionBatch",
    "InstructionDataset",
    "InstructionFields",
    "collate_instructions",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "MixtureSampler",
    "PreparedDataError",
    "PreparedDataReader",
    "PreparedDataset",
    "PreferenceBatch",
    "PromptBatch",
    "PromptDataset",
    "PromptExample",
    "collate_prompts",
    "PreferenceDataset",
    "PreferenceFields",
    "PreferencePair",
    "collate_preference_pairs",
    "TextBatch",
    "TextDataError",
    "TextDataReader",
    "TextSource",
    "Tokenizer",
    "find_files",
    "is_prepared_dataset",
    "load_tokenizer",
    "parse_mixture",
    "prepare_dataset",
]
