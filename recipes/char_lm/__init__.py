"""``recipes.char_lm``: a byte-level transformer on text files; see
:mod:`recipes.char_lm.recipe`. ``python -m recipes.char_lm OUTPUT_DIR`` runs it."""

from __future__ import annotations

from recipes.char_lm.config import CharLMConfig, DataSection, ModelSection
from recipes.char_lm.data import ByteWindows, CharBatch, LMBatch, collate_windows, load_corpus
from recipes.char_lm.model import (
    Block,
    ByteTransformer,
    CharLMEvalUnit,
    CharLMTrainUnit,
    build_model,
    flops_per_target,
)
from recipes.char_lm.recipe import recipe

__all__ = [
    "Block",
    "ByteTransformer",
    "ByteWindows",
    "CharBatch",
    "CharLMConfig",
    "CharLMEvalUnit",
    "CharLMTrainUnit",
    "DataSection",
    "LMBatch",
    "ModelSection",
    "build_model",
    "collate_windows",
    "flops_per_target",
    "load_corpus",
    "recipe",
]
