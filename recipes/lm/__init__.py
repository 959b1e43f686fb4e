"""``recipes.lm``: train or fine-tune a causal language model on your files (pretraining, SFT,
preference tuning, GRPO); see :mod:`recipes.lm.recipe`, docs/lm-recipe.md and docs/rl.md.
``python -m recipes.lm OUTPUT_DIR`` runs it."""

from __future__ import annotations

from recipes.lm.config import (
    DataSection,
    GrpoSection,
    LMConfig,
    LMGangSection,
    ModelSection,
    TokenizerSection,
)
from recipes.lm.data import build_readers, load_recipe_tokenizer, packed_valid_set
from recipes.lm.model import BuiltModel, bias_update, build_model
from recipes.lm.preference import PreferenceSection
from recipes.lm.recipe import build_trainer, recipe
from recipes.lm.units import build_reference, build_units

__all__ = [
    "BuiltModel",
    "DataSection",
    "GrpoSection",
    "LMConfig",
    "LMGangSection",
    "ModelSection",
    "PreferenceSection",
    "TokenizerSection",
    "bias_update",
    "build_model",
    "build_readers",
    "build_reference",
    "build_trainer",
    "build_units",
    "load_recipe_tokenizer",
    "packed_valid_set",
    "recipe",
]
