"""What ``runtime`` exports: each name from its module, loaded on first use only."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import runtime
from tests.conftest import child_env


def test_import_runtime_loads_none_of_its_modules_nor_torch() -> None:
    # `import runtime`, `--help` and a config error stay fast: nothing heavy runs before a use.
    code = (
        "import sys, runtime; "
        "print(sorted(m for m in sys.modules if m.startswith('runtime.')), 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["[]", "False"]


def test_each_exported_name_is_the_object_of_the_module_that_its_import_names() -> None:
    exports = runtime._exports()
    assert len(exports) >= 50
    assert sorted(runtime.__all__) == sorted(exports) == dir(runtime)
    for name, module in exports.items():
        assert getattr(runtime, name) is getattr(importlib.import_module(module), name), name
    names: dict[str, object] = {}
    exec("from runtime import *", names)
    assert set(names) - {"__builtins__"} == set(exports)


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match=r"^module 'runtime' has no attribute 'NoSuchName'$"):
        getattr(runtime, "NoSuchName")  # noqa: B009
