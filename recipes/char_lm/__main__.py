"""``python -m recipes.char_lm OUTPUT_DIR [--config key=value]...`` (see
:mod:`recipes.char_lm.recipe`)."""

from __future__ import annotations

from recipes.char_lm.config import CharLMConfig
from recipes.char_lm.recipe import recipe
from runtime import main

if __name__ == "__main__":
    main(recipe, CharLMConfig)
