"""Recipe configs: dataclasses filled from defaults, YAML files and ``key.sub=value`` overrides.

A config is a (nested) ``@dataclass`` whose fields have defaults. :func:`load_config` starts from
those defaults, merges the YAML files in order (nested mappings key by key, later wins), applies the
overrides in order, checks every value against its annotation and finally calls each section's
optional ``validate()`` hook. :func:`dump_config` writes a config back as YAML that loads to an
equal config.

A config describes itself: the docstring on the line under a field (a string literal, as for a
function) is that key's meaning, which :func:`config_help` lists, and
:func:`describe_config` prints every key's value with the required ones marked, even before they
are given. A key is required when its field has no default, or when it is one of a group of keys
of which exactly one must be set (:func:`exactly_one_of`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import os
import re
import textwrap
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePath
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    TypeGuard,
    TypeVar,
    Union,
    final,
    get_args,
    get_origin,
    get_type_hints,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ConfigT = TypeVar("ConfigT")

_NONE_TYPE = type(None)


@final
class ConfigError(ValueError):
    """A config file, override or value is wrong; the message says which and how to fix it."""

    def __init__(self, message: str, *, key: str | None = None, missing: bool = False) -> None:
        super().__init__(message)
        # The dotted key the error is about, so the loader can say which file or override set it.
        self.key = key
        # A required key was not given: the config is incomplete rather than wrong.
        self.missing = missing


def load_config(
    config_class: type[ConfigT],
    *,
    config_files: Sequence[Path | str] = (),
    overrides: Sequence[str] = (),
) -> ConfigT:
    """Build a ``config_class``: dataclass defaults < ``config_files`` in order < ``overrides`` in order.

    Each override is ``key.sub=value`` with ``value`` parsed as YAML (``3`` is an int, ``true`` a
    bool, ``null`` None). Raises :class:`ConfigError` for unreadable files, unknown keys, values of
    the wrong type and values a ``validate()`` hook rejects.
    """
    data, origins = _merged_data(config_class, config_files, overrides)
    return _build(config_class, data, origins)


def describe_config(
    config_class: type[object],
    *,
    config_files: Sequence[Path | str] = (),
    overrides: Sequence[str] = (),
) -> str:
    """Every key of ``config_class`` as YAML, valued as :func:`load_config` would value it, each
    required key marked with a ``# required`` comment.

    Unlike :func:`load_config` this accepts a config whose required keys are not given yet (they
    show as ``null``), so it shows what a recipe needs before anything is set. Any other error
    (an unknown key, a wrong type, a value ``validate()`` rejects) raises :class:`ConfigError`.
    """
    data, origins = _merged_data(config_class, config_files, overrides)
    try:
        data = config_to_dict(_build(config_class, data, origins))
    except ConfigError as ex:
        if not ex.missing:
            raise
    return "".join(_annotated_yaml(config_class, data, ""))


def config_from_dict(config_class: type[ConfigT], data: Mapping[str, object]) -> ConfigT:
    """Build a ``config_class`` from its defaults updated by the (nested) mapping ``data``."""
    return _build(config_class, _merge(_default_data(config_class), data), {})


def read_config_file(path: Path | str) -> dict[str, object]:
    """Read one YAML config file; an empty file is an empty mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"Config file '{path}' does not exist. Check the path given to --config-file."
        ) from None
    except (OSError, UnicodeDecodeError) as ex:
        raise ConfigError(f"Config file '{path}' cannot be read: {ex}") from None
    import yaml  # imported when a config is read: a recipe's --help needs no YAML

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as ex:
        raise ConfigError(f"Config file '{path}' is not valid YAML: {_one_line(str(ex))}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file '{path}' must hold a mapping of config keys at its top level, but holds "
            f"{_show(data)}. Write it as 'key: value' lines."
        )
    return data


def parse_override(override: str) -> tuple[str, object]:
    """Split ``key.sub=value`` into the dotted key and the YAML-parsed value."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"Config override '{override}' must have the form key.sub=value, e.g. gang.tp_size=2."
        )
    if any(not part for part in key.split(".")):
        raise ConfigError(
            f"Config override '{override}' has an empty part in its key '{key}'. "
            "Separate the parts with single dots, e.g. gang.tp_size=2."
        )
    import yaml  # imported when a config is read: a recipe's --help needs no YAML

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as ex:
        raise ConfigError(
            f"Config override '{override}' has a value that is not valid YAML: "
            f"{_one_line(str(ex))}. Quote the value if it is meant as a string."
        ) from None
    return key, value


def config_to_dict(config: object) -> dict[str, object]:
    """The config as plain YAML-able data: Paths become strings and tuples become lists."""
    if not _is_dataclass_instance(config):
        raise TypeError(
            f"config must be a dataclass instance, but is {config!r} of type "
            f"{type(config).__name__} instead."
        )
    data = _to_plain(config, "")
    assert isinstance(data, dict)
    return data


def dump_config(config: object) -> str:
    """The config as YAML text, in field order; :func:`load_config` reads it back unchanged."""
    import yaml

    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)


def config_changes(previous_text: str | None, config: object) -> list[str]:
    """``key: old -> new`` for each value ``config`` changes from the YAML ``previous_text``.

    ``previous_text`` is the ``config.yaml`` an earlier run wrote (``None``: there was none).
    """
    if previous_text is None:
        return []
    import yaml

    try:
        previous = yaml.safe_load(previous_text)
    except yaml.YAMLError:
        return ["config.yaml of the earlier run is not valid YAML"]
    if not isinstance(previous, dict):
        return ["config.yaml of the earlier run is not a mapping"]
    old, new = _flatten(previous), _flatten(config_to_dict(config))
    missing = object()
    return [
        f"{key}: {_brief(old.get(key, missing))} -> {_brief(new.get(key, missing))}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, missing) != new.get(key, missing)
    ]


def _flatten(data: dict[Any, Any], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _brief(value: object) -> str:
    return "(absent)" if not isinstance(value, _Plain) else repr(value)


_Plain = (type(None), bool, int, float, str, list, dict)


# --------------------------------------------------------------------------- merging


def _default_data(config_class: type[object]) -> dict[str, object]:
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise TypeError(
            f"config_class must be a dataclass type, but is {config_class!r} instead. "
            "Decorate the config class with @dataclass."
        )
    # The defaults go through the same merge as files and overrides, so a section whose
    # default_factory sets non-default values keeps them when only one of its keys is overridden.
    data: dict[str, object] = {}
    for field in dataclasses.fields(config_class):
        if not field.init:
            continue
        if field.default is not dataclasses.MISSING:
            data[field.name] = _to_plain(field.default, field.name)
        elif field.default_factory is not dataclasses.MISSING:
            data[field.name] = _to_plain(field.default_factory(), field.name)
    return data


def _merged_data(
    config_class: type[object], config_files: Sequence[Path | str], overrides: Sequence[str]
) -> tuple[dict[str, object], dict[str, str]]:
    """Defaults < files < overrides as plain data, and which file or override set each key."""
    data = _default_data(config_class)
    origins: dict[str, str] = {}
    for file in config_files:
        file_data = read_config_file(file)
        data = _merge(data, file_data)
        _record_origins(file_data, "", f"config file '{file}'", origins)
    for override in overrides:
        key, value = parse_override(override)
        data = _merge(data, _nest(key.split("."), value))
        origins[key] = f"--config {override}"
    return data, origins


def _merge(base: Mapping[str, object], update: Mapping[str, object]) -> dict[str, object]:
    merged = dict(base)
    for key, value in update.items():
        current = merged.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            merged[key] = _merge(current, value)
        else:
            merged[key] = value
    return merged


def _nest(parts: Sequence[str], value: object) -> dict[str, object]:
    if len(parts) == 1:
        return {parts[0]: value}
    return {parts[0]: _nest(parts[1:], value)}


def _record_origins(
    data: Mapping[Any, object], prefix: str, origin: str, origins: dict[str, str]
) -> None:
    for key, value in data.items():
        path = _join(prefix, str(key))
        origins[path] = origin
        if isinstance(value, Mapping):
            _record_origins(value, path, origin, origins)


def _key_prefixes(key: str) -> Iterator[str]:
    parts = re.split(r"(?=[.\[])", key)
    for end in range(len(parts), 0, -1):
        yield "".join(parts[:end])


def _find_origin(key: str | None, origins: Mapping[str, str]) -> str | None:
    if key is None:
        return None
    for prefix in _key_prefixes(key):
        if prefix in origins:
            return origins[prefix]
    # `--config foo.bar=1` with an unknown `foo` fails at `foo`, above what the override named.
    return next((o for k, o in origins.items() if k.startswith((f"{key}.", f"{key}["))), None)


def _build(
    config_class: type[ConfigT], data: Mapping[str, object], origins: Mapping[str, str]
) -> ConfigT:
    try:
        config = _structure(config_class, data, "")
    except ConfigError as ex:
        origin = _find_origin(ex.key, origins)
        if origin is None:
            raise
        # With several files and overrides the bare key does not say where to look.
        raise ConfigError(f"{ex} (from {origin})", key=ex.key, missing=ex.missing) from None
    assert isinstance(config, config_class)
    _validate(config, "")
    return config


# ------------------------------------------------------------------------- structuring


def _structure(tp: Any, value: object, key: str) -> object:
    """``value`` as an instance of the annotation ``tp``; ``key`` names it in errors."""
    origin = get_origin(tp)
    args = get_args(tp)

    if tp is Any:
        return value
    if tp is _NONE_TYPE or tp is None:
        if value is None:
            return None
        raise _wrong_type(key, tp, value)
    if origin is Union or origin is types.UnionType:
        return _structure_union(tp, args, value, key)
    if origin is Literal:
        for allowed in args:
            if value == allowed and type(value) is type(allowed):
                return allowed
        raise _wrong_type(key, tp, value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _structure_dataclass(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _wrong_type(key, tp, value)
    if tp is int:
        # bool is an int subclass, but `steps: true` is surely a mistake.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _wrong_type(key, tp, value)
    if tp is float:
        return _structure_float(value, key)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _wrong_type(key, tp, value, hint=" Quote the value to pass it as a string.")
    if tp is Path or tp is PurePath:
        if isinstance(value, str | os.PathLike):
            return Path(value)
        raise _wrong_type(key, tp, value)
    if tp is list or origin is list:
        item_tp = args[0] if args else Any
        items = _expect_sequence(tp, value, key)
        return [_structure(item_tp, item, f"{key}[{i}]") for i, item in enumerate(items)]
    if tp is tuple or origin is tuple:
        return _structure_tuple(tp, args, value, key)
    if tp is dict or origin is dict:
        return _structure_dict(tp, args, value, key)
    raise TypeError(
        f"Config key '{key}' is annotated as {_type_name(tp)}, which configs do not support. "
        "Use bool, int, float, str, Path, Literal, X | None, list, tuple, dict[str, X] or a "
        "nested dataclass."
    )


def _structure_union(tp: Any, args: tuple[Any, ...], value: object, key: str) -> object:
    if value is None and _NONE_TYPE in args:
        return None
    arms = [arm for arm in args if arm is not _NONE_TYPE]
    if len(arms) == 1:
        try:
            return _structure(arms[0], value, key)
        except ConfigError as ex:
            # An error deeper inside (a section's unknown key, a list item) is the precise one.
            if ex.key != key:
                raise
            raise _wrong_type(key, tp, value) from None
    for arm in arms:
        try:
            return _structure(arm, value, key)
        except ConfigError:
            continue
    raise _wrong_type(key, tp, value)


def _structure_float(value: object, key: str) -> float:
    if isinstance(value, bool):
        raise _wrong_type(key, float, value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        # YAML 1.1 reads `1e-3` (no dot) as a string, which is how people write learning rates.
        try:
            return float(value)
        except ValueError:
            pass
    raise _wrong_type(key, float, value)


def _structure_dataclass(cls: type[DataclassInstance], value: object, key: str) -> object:
    if not isinstance(value, Mapping):
        raise _wrong_type(key, cls, value)
    fields = {field.name: field for field in dataclasses.fields(cls) if field.init}
    hints = _type_hints(cls)
    kwargs: dict[str, object] = {}
    for name, item in value.items():
        if not isinstance(name, str) or name not in fields:
            raise _unknown_key(key, str(name), list(fields))
        kwargs[name] = _structure(hints[name], item, _join(key, name))
    for name, field in fields.items():
        has_default = (
            field.default is not dataclasses.MISSING
            or field.default_factory is not dataclasses.MISSING
        )
        if name not in kwargs and not has_default:
            full_key = _join(key, name)
            raise ConfigError(
                f"Config key '{full_key}' has no default and was not given. "
                f"Set it in a config file or with --config {full_key}=VALUE.",
                key=full_key,
                missing=True,
            )
    try:
        return cls(**kwargs)
    except ValueError as ex:
        # A __post_init__ check: report it like a validate() failure.
        raise ConfigError(f"{_section_name(key)} is invalid: {ex}", key=key) from None


def _structure_tuple(tp: Any, args: tuple[Any, ...], value: object, key: str) -> tuple[object, ...]:
    items = _expect_sequence(tp, value, key)
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        item_tp = args[0] if args else Any
        return tuple(_structure(item_tp, item, f"{key}[{i}]") for i, item in enumerate(items))
    if len(items) != len(args):
        raise ConfigError(
            f"Config key '{key}' expects {_type_name(tp)} ({len(args)} items), but got "
            f"{_show(value)} with {len(items)} items.",
            key=key,
        )
    return tuple(
        _structure(item_tp, item, f"{key}[{i}]")
        for i, (item_tp, item) in enumerate(zip(args, items, strict=True))
    )


def _structure_dict(tp: Any, args: tuple[Any, ...], value: object, key: str) -> dict[str, object]:
    key_tp, item_tp = args if args else (str, Any)
    if key_tp is not str:
        raise TypeError(
            f"Config key '{key}' is annotated as {_type_name(tp)}, but config mappings need str "
            "keys. Annotate it as dict[str, X]."
        )
    if not isinstance(value, Mapping):
        raise _wrong_type(key, tp, value)
    result: dict[str, object] = {}
    for name, item in value.items():
        if not isinstance(name, str):
            raise ConfigError(
                f"Config key '{key}' expects {_type_name(tp)}, but got the key {_show(name)}. "
                "Quote the key to make it a string.",
                key=key,
            )
        result[name] = _structure(item_tp, item, _join(key, name))
    return result


def _expect_sequence(tp: Any, value: object, key: str) -> Sequence[object]:
    # A str is a Sequence too, but `layers=abc` is never meant as ['a', 'b', 'c'].
    if isinstance(value, list | tuple):
        return value
    raise _wrong_type(key, tp, value, hint=" Write it as a YAML list, e.g. [1, 2].")


def _type_hints(cls: type[object]) -> dict[str, Any]:
    try:
        return get_type_hints(cls)
    except Exception as ex:
        raise TypeError(
            f"The annotations of config class {cls.__qualname__} cannot be resolved: {ex}. "
            "Define the class at module level, with every name its annotations use importable."
        ) from ex


# ------------------------------------------------------------------------- validation


def _validate(value: object, key: str) -> None:
    """Call ``validate()`` on every section, innermost first, so a parent sees valid sections.

    A section's :func:`exactly_one_of` groups are checked before its ``validate()``, which may
    then rely on the group's key being there.
    """
    if _is_dataclass_instance(value):
        for field in dataclasses.fields(value):
            _validate(getattr(value, field.name), _join(key, field.name))
        _check_groups(value, key)
        validate = getattr(value, "validate", None)
        if callable(validate):
            try:
                validate()
            except ValueError as ex:
                raise ConfigError(f"{_section_name(key)} is invalid: {ex}", key=key) from None
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _validate(item, f"{key}[{i}]")
    elif isinstance(value, dict):
        for name, item in value.items():
            _validate(item, _join(key, str(name)))


def _check_groups(section: DataclassInstance, key: str) -> None:
    for group in _groups(type(section)).values():
        given = [name for name in group if getattr(section, name) is not None]
        if len(given) == 1:
            continue
        keys = [_join(key, name) for name in group]
        if len(given) == len(group) == 2:
            problem = "both are set"
        elif given:
            problem = f"{_and([_join(key, name) for name in given])} are all set"
        else:
            problem = "neither is set" if len(group) == 2 else "none is set"
        meanings = field_meanings(type(section))
        explained = " ".join(
            f"{_join(key, name)}: {meanings[name]}" for name in group if name in meanings
        )
        raise ConfigError(
            f"Give exactly one of {_and(keys, 'or')}, but {problem}. {explained}".rstrip(),
            key=keys[0],
            missing=not given,
        )


# ------------------------------------------------------------- what the keys mean

_GROUP = "exactly_one_of"


def exactly_one_of(group: str) -> dict[str, str]:
    """``field`` metadata for a required choice: of the fields of one section that name the same
    ``group``, exactly one must be set (not None). They default to None; for instance::

        hf_path: Path | None = field(default=None, metadata=exactly_one_of("model"))
        name: str | None = field(default=None, metadata=exactly_one_of("model"))
    """
    return {_GROUP: group}


def _groups(cls: type[object]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if _GROUP in field.metadata:
            groups.setdefault(field.metadata[_GROUP], []).append(field.name)
    return groups


def _requirement(cls: type[object], field: dataclasses.Field[Any], section: str) -> str | None:
    """Why the key of ``field`` (in ``section``, a dotted key) must be given; None: it need not."""
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        return "required"
    if _GROUP in field.metadata:
        group = _groups(cls)[field.metadata[_GROUP]]
        others = [_join(section, name) for name in group if name != field.name]
        return f"required, unless {_and(others, 'or')} is given"
    return None


def field_meanings(cls: type[object]) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (or of its dataclass bases), by
    field name: its first paragraph on one line.

    Python keeps no such docstring at run time, so it is read from the class's source; a class
    whose source cannot be found (one made in a REPL) has no meanings.
    """
    meanings: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = next(node.body for node in tree.body if isinstance(node, ast.ClassDef))
        for statement, after in itertools.pairwise(body):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                meanings[statement.target.id] = _first_paragraph(after.value.value)
    return meanings


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One key of a config class, as :func:`config_keys` lists it."""

    name: str
    """The dotted key, as ``--config`` takes it."""
    meaning: str
    """The field's docstring (a section's may come from its class's), on one line; may be ''."""
    requirement: str | None
    """Why the key must be given (see :func:`exactly_one_of`); None when it need not be."""
    is_section: bool
    """A nested dataclass, whose keys follow it."""


def config_keys(config_class: type[object], prefix: str = "") -> list[ConfigKey]:
    """Every key of ``config_class`` in field order, each section before its keys."""
    hints = _type_hints(config_class)
    meanings = field_meanings(config_class)
    keys: list[ConfigKey] = []
    for field in dataclasses.fields(config_class):  # type: ignore[arg-type]
        if not field.init:
            continue
        name = _join(prefix, field.name)
        section = hints[field.name]
        is_section = isinstance(section, type) and dataclasses.is_dataclass(section)
        meaning = meanings.get(field.name, "")
        if is_section and not meaning and section.__doc__ and not _is_generated_doc(section):
            meaning = _first_paragraph(section.__doc__)
        requirement = _requirement(config_class, field, prefix)
        keys.append(ConfigKey(name, meaning, requirement, is_section))
        if is_section:
            keys.extend(config_keys(section, name))
    return keys


def keys_named(config_class: type[object], names: Sequence[str]) -> dict[str, str]:
    """The dotted key of each of ``names`` that is the name of exactly one (non-section) key of
    ``config_class``, e.g. ``{"ep_size": "gang.ep_size"}``: how a user spells a setting that the
    recipe hands on as a keyword argument of that name."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for key in config_keys(config_class):
        leaf = key.name.rpartition(".")[2]
        if leaf in found and not key.is_section:
            found[leaf].append(key.name)
    return {name: keys[0] for name, keys in found.items() if len(keys) == 1}


def config_help(config_class: type[object], *, width: int = 80) -> str:
    """The keys of ``config_class`` with their meanings, for a command's ``--help``."""
    lines = textwrap.wrap(
        "config keys (set with --config KEY=VALUE or in a --config-file; --dump-config prints "
        "their values):",
        width,
    )
    for key in config_keys(config_class):
        if key.is_section and not key.meaning:
            continue  # its keys follow, each with the section's name
        text = key.meaning
        if key.requirement is not None:
            text = f"[{key.requirement}] {text}".rstrip()
        lines.extend(_help_entry(key.name, text, width=width))
    return "\n".join(lines)


_HELP_COLUMN = 26
"""Where the meanings start, as argparse places an option's help."""


def _help_entry(name: str, text: str, *, width: int) -> list[str]:
    head = f"  {name}"
    indent = " " * _HELP_COLUMN
    wrapped = textwrap.wrap(text, max(width - _HELP_COLUMN, 20)) or [""]
    if len(head) + 2 <= _HELP_COLUMN:
        first, rest = head.ljust(_HELP_COLUMN) + wrapped[0], wrapped[1:]
        return [first.rstrip(), *(indent + line for line in rest)]
    return [head, *(indent + line for line in wrapped if line)]


def _annotated_yaml(cls: type[object], data: Mapping[str, object], section: str) -> Iterator[str]:
    """``data`` as YAML lines in field order, each required key followed by a comment."""
    import yaml

    indent = "  " * len(section.split(".")) if section else ""
    hints = _type_hints(cls)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not field.init:
            continue
        requirement = _requirement(cls, field, section)
        note = f"  # {requirement}" if requirement else ""
        section_class = hints[field.name]
        value = data.get(field.name)
        if isinstance(section_class, type) and dataclasses.is_dataclass(section_class) and value:
            assert isinstance(value, Mapping)
            yield f"{indent}{field.name}:{note}\n"
            yield from _annotated_yaml(section_class, value, _join(section, field.name))
            continue
        text = yaml.safe_dump(
            {field.name: value}, sort_keys=False, default_flow_style=False, width=float("inf")
        )
        first, *rest = text.splitlines()
        yield f"{indent}{first}{note}\n"
        yield from (f"{indent}{line}\n" for line in rest)


def _first_paragraph(doc: str) -> str:
    paragraph = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(paragraph.replace("``", "").split())


def _is_generated_doc(cls: type[object]) -> bool:
    # @dataclass gives a class without a docstring its signature as one.
    return (cls.__doc__ or "").startswith(f"{cls.__name__}(")


def _and(names: Sequence[str], last: str = "and") -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


# ---------------------------------------------------------------------- plain data


def _to_plain(value: object, key: str) -> object:
    if _is_dataclass_instance(value):
        return {
            field.name: _to_plain(getattr(value, field.name), _join(key, field.name))
            for field in dataclasses.fields(value)
            if field.init
        }
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {name: _to_plain(item, _join(key, str(name))) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(item, f"{key}[{i}]") for i, item in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"Config key '{key}' holds {_show(value)}, which cannot be written as YAML. "
        "Config values must be bool, int, float, str, Path, None, lists, tuples, dicts or "
        "dataclasses."
    )


# -------------------------------------------------------------------------- messages


def _wrong_type(key: str, tp: Any, value: object, *, hint: str = "") -> ConfigError:
    return ConfigError(
        f"Config key '{key}' expects {_describe(tp)}, but got {_show(value)}.{hint}", key=key
    )


def _unknown_key(section: str, name: str, valid: list[str]) -> ConfigError:
    full_key = _join(section, name)
    where = f"under '{section}'" if section else "at the top level"
    message = f"Unknown config key '{full_key}'. Valid keys {where}: {', '.join(valid)}."
    match = difflib.get_close_matches(name, valid, n=1)
    if match:
        message += f" Did you mean '{_join(section, match[0])}'?"
    return ConfigError(message, key=full_key)


def _describe(tp: Any) -> str:
    """``tp`` as the phrase after 'expects'."""
    origin = get_origin(tp)
    if tp is _NONE_TYPE or tp is None:
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in get_args(tp))
    if origin is Union or origin is types.UnionType:
        return " or ".join(_describe(arg) for arg in get_args(tp))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} keys"
    return _type_name(tp)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    args = get_args(tp)
    if tp is _NONE_TYPE or tp is None:
        return "None"
    if tp is Ellipsis:
        return "..."
    if origin is Literal:
        return f"Literal[{', '.join(repr(arg) for arg in args)}]"
    if origin is Union or origin is types.UnionType:
        return " | ".join(_type_name(arg) for arg in args)
    if origin is not None and args:
        return f"{_type_name(origin)}[{', '.join(_type_name(arg) for arg in args)}]"
    if isinstance(tp, type):
        return tp.__name__
    return repr(tp)


def _show(value: object) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _section_name(key: str) -> str:
    return f"Config section '{key}'" if key else "The config"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _is_dataclass_instance(value: object) -> TypeGuard[DataclassInstance]:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)
