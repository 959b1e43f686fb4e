"""``python -m recipes.lm OUTPUT_DIR [--config key=value]...`` (see :mod:`recipes.lm.recipe`)."""

from __future__ import annotations

from recipes.lm.config import LMConfig
from recipes.lm.recipe import recipe
from runtime import main

if __name__ == "__main__":
    main(recipe, LMConfig)
