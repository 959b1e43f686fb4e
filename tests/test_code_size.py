"""The style bounds of the source: no class over 350 lines, no function body over 60 (its
docstring aside), so that each piece can be read at one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 350
MAX_FUNCTION_BODY_LINES = 60


def _oversized(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ClassDef):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if lines > MAX_CLASS_LINES:
                found.append(f"{where} class {node.name}: {lines} lines")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            body = node.body
            if ast.get_docstring(node) is not None and len(body) > 1:
                body = body[1:]
            lines = node.end_lineno - body[0].lineno + 1  # type: ignore[operator]
            if lines > MAX_FUNCTION_BODY_LINES:
                found.append(f"{where} function {node.name}: a body of {lines} lines")
    return found


def test_no_class_or_function_is_over_the_style_bounds() -> None:
    paths = [
        p
        for folder in ("src", "recipes", "benchmarks", "scripts")
        for p in ROOT.glob(f"{folder}/**/*.py")
    ]
    assert paths
    found = [entry for path in sorted(paths) for entry in _oversized(path)]
    assert not found, (
        f"Over the bounds (a class {MAX_CLASS_LINES} lines, a function body "
        f"{MAX_FUNCTION_BODY_LINES}); cut along a concern of its own:\n" + "\n".join(found)
    )
