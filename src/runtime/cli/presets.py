"""A recipe's named presets: YAML config files shipped beside it (``configs/NAME.yaml`` in the
recipe's package), picked on the command line with ``--preset NAME`` and applied before any
``--config-file``, as fairseq2's recipes ship theirs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PRESETS_DIR = "configs"


def recipe_presets(recipe: Callable[..., Any]) -> dict[str, Path]:
    """The presets of ``recipe`` by name: the ``*.yaml`` files of ``configs/`` beside the module
    that defines it; none for a recipe without one (a script, say)."""
    module = sys.modules.get(recipe.__module__)
    source = getattr(module, "__file__", None)
    if source is None:
        return {}
    directory = Path(source).parent / PRESETS_DIR
    return {path.stem: path for path in sorted(directory.glob("*.yaml"))}
