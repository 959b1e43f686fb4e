"""Every name a package lists in ``__all__`` is there (ruff's F401 holds the other direction:
every name an ``__init__`` imports is listed)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package", ["gangs", "units", "checkpoint", "runtime"])
def test_every_name_a_package_exports_is_there(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ lists names it does not have: {missing}"
