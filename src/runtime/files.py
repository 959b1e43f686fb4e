"""Small file helpers shared by the runtime's writers."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
