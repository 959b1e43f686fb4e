"""The import arrows of ``src/`` run one way: no cycle between modules, and no arrow back up a floor.

Packages, bottom to top: ``trainkit_utils`` (the standard library and torch only); ``gangs``;
``units`` and ``checkpoint`` (beside each other, neither importing the other); ``models`` (which
may use ``units``, for the units of a model of its own); ``runtime``. No installed package
imports ``recipes``, which may import them all and has no cycle of its own. Inside ``runtime``, top to bottom: the package itself
(``runtime/__init__.py``, ``__main__.py``), ``cli``, ``training``, then ``metrics``, ``parallel``
and ``data`` on one floor; ``runtime/errors.py`` is a leaf that any floor may import.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: a lazy import is
still an arrow a reader follows. The graph is read from the source (``ast``), nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

PACKAGES_BELOW: Mapping[str, frozenset[str]] = {
    "trainkit_utils": frozenset(),
    "gangs": frozenset({"trainkit_utils"}),
    "units": frozenset({"trainkit_utils", "gangs"}),
    "checkpoint": frozenset({"trainkit_utils", "gangs"}),
    "models": frozenset({"trainkit_utils", "gangs", "units"}),
    "runtime": frozenset({"trainkit_utils", "gangs", "units", "checkpoint", "models"}),
}
"""What each package may import, besides itself."""

RUNTIME_FLOORS: Mapping[str, int] = {
    "runtime": 4,
    "runtime.cli": 3,
    "runtime.training": 2,
    "runtime.metrics": 1,
    "runtime.parallel": 1,
    "runtime.data": 1,
    "runtime.errors": 0,
}
"""The floor of each part of ``runtime``; an arrow may stay on its floor or go down."""

THIRD_PARTY_OF_UTILS = frozenset({"torch", "typing_extensions"})


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imported_names(path: Path, module: str) -> set[str]:
    """The absolute names of what ``module`` (at ``path``) imports: modules, or modules'
    attributes (``from a.b import c`` gives ``a.b.c``, a module or an attribute of ``a.b``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            names.update(
                source if alias.name == "*" else f"{source}.{alias.name}" for alias in node.names
            )
    return names


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (an imported attribute counts as an arrow
    to the module that defines it)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path, module):
            # ``from a.b import c``: the module a.b.c if there is one, else a.b.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) of each strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, set(group)) for group in groups]


def _one_cycle(graph: Mapping[str, Iterable[str]], group: set[str]) -> list[str]:
    """A path from the group's first module back to it, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph.get(node, ())):
            if target == start:
                return [*paths[node], start]
            if target in group and target not in paths:
                paths[target] = [*paths[node], target]
                frontier.append(target)
    raise AssertionError(f"no cycle through {start}")


def runtime_floor(module: str) -> int:
    parts = module.split(".")
    return RUNTIME_FLOORS.get(".".join(parts[:2]), RUNTIME_FLOORS["runtime"])


def wrong_arrows(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Each arrow that runs up a floor, or to a package the importer may not use."""
    wrong = []
    for module, targets in sorted(graph.items()):
        package = module.split(".")[0]
        for target in sorted(targets):
            target_package = target.split(".")[0]
            if target_package != package:
                if target_package not in PACKAGES_BELOW.get(package, frozenset()):
                    wrong.append(f"{module} -> {target} ({package} may not import it)")
            elif package == "runtime" and runtime_floor(target) > runtime_floor(module):
                wrong.append(f"{module} -> {target} (up a floor inside runtime)")
    return wrong


def outside_imports(modules: Mapping[str, Path], package: str) -> list[str]:
    """What ``package`` imports besides itself, the standard library and torch."""
    found = []
    for module, path in modules.items():
        if module.split(".")[0] != package:
            continue
        for name in imported_names(path, module):
            top = name.split(".")[0]
            allowed = {package, "__future__", *THIRD_PARTY_OF_UTILS}
            if top not in allowed and top not in sys.stdlib_module_names:
                found.append(f"{module} imports {name}")
    return sorted(found)


@functools.cache
def src_graph() -> dict[str, set[str]]:
    return import_graph(read_modules(SRC))


def test_src_has_no_import_cycle() -> None:
    graph = src_graph()
    assert {"runtime.training.step", "checkpoint.manager", "trainkit_utils.arguments"} <= set(graph)
    cycles = find_cycles(graph)
    assert not cycles, "Import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_src_imports_only_down_the_floors() -> None:
    graph = src_graph()
    assert {m.split(".")[0] for m in graph} == set(PACKAGES_BELOW)
    wrong = wrong_arrows(graph)
    assert not wrong, "Arrows against the layering:\n" + "\n".join(wrong)


def test_no_installed_package_imports_recipes() -> None:
    found = [
        f"{module} imports {name}"
        for module, path in read_modules(SRC).items()
        for name in imported_names(path, module)
        if name.split(".")[0] == "recipes"
    ]
    assert not found, "\n".join(found)


def test_recipes_have_no_import_cycle() -> None:
    graph = import_graph({**read_modules(SRC), **read_modules_under(ROOT, "recipes")})
    assert {"recipes.lm.recipe", "recipes.char_lm.recipe"} <= set(graph)
    cycles = find_cycles(graph)
    assert not cycles, "Import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def read_modules_under(root: Path, package: str) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def test_trainkit_utils_imports_only_the_standard_library_and_torch() -> None:
    found = outside_imports(read_modules(SRC), "trainkit_utils")
    assert not found, "\n".join(found)


def test_the_checks_find_a_cycle_an_upward_arrow_and_a_forbidden_package(
    tmp_path: Path,
) -> None:
    """The checks themselves, on a small tree that breaks each rule once."""
    files = {
        "runtime/__init__.py": "",
        "runtime/errors.py": "",
        "runtime/data/__init__.py": "from .data_reader import DataReader\n",
        "runtime/data/data_reader.py": "def f():\n    from runtime.training.loop import x\n",
        "runtime/training/__init__.py": "",
        "runtime/training/loop.py": "from runtime.data import DataReader\nx = 1\n",
        "runtime/training/step.py": "from runtime.errors import E\n",
        "gangs/__init__.py": "",
        "gangs/gang.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from checkpoint import CheckpointManager\n",
        "checkpoint/__init__.py": "",
        "trainkit_utils/__init__.py": "import yaml\nimport os\nimport torch\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = read_modules(tmp_path)
    graph = import_graph(modules)

    assert find_cycles(graph) == [
        ["runtime.data", "runtime.data.data_reader", "runtime.training.loop", "runtime.data"]
    ]
    assert wrong_arrows(graph) == [
        "gangs.gang -> checkpoint (gangs may not import it)",
        "runtime.data.data_reader -> runtime.training.loop (up a floor inside runtime)",
    ]
    assert outside_imports(modules, "trainkit_utils") == ["trainkit_utils imports yaml"]
