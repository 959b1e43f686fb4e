"""Start a model from weights: an exported file or another run's checkpoint, any layout.

The source is one of:

- a file written by ``python -m runtime export`` (``torch.load`` format, read memory-mapped so
  each rank pages in only the slices it keeps), or a ``.safetensors`` file;
- a Hugging Face model directory: ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``, each tensor read when it is copied;
- a run directory (its last checkpoint), its ``checkpoints/`` directory (the last one), or one
  ``step_N`` directory: read with ``torch.distributed.checkpoint``, each rank reading only its
  own shards, whatever layout saved it.

Keys may be renamed (``rename``: source prefix -> model prefix) and left out (``skip``: glob
patterns, matched against the model's names: such model weights keep their initialization and
such source weights are ignored). Any other mismatch is an :class:`InitialWeightsError` that
lists the missing and the unexpected keys.
"""

from __future__ import annotations

import fnmatch
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, final

import torch
from torch import Tensor
from torch.nn import Module

from checkpoint import CheckpointError, CheckpointManager
from gangs import Gangs
from models.hf.conversion import (
    ConversionError,
    ConvertedCheckpoint,
    weight_conversions,
)
from runtime.parallel.materialize import canonical_name, copy_own_slice
from runtime.parallel.tying import shared_parameters
from trainkit_utils.modules import split_ties, unwrap_model

log = logging.getLogger(__name__)

_MAX_LISTED_KEYS = 10


class InitialWeightsError(ValueError):
    """The initial weights cannot be loaded into the model (missing or unexpected keys, shapes)."""


@final
@dataclass(frozen=True)
class InitSource:
    """One source of initial weights with its own key mapping: ``rename`` (source prefix ->
    model prefix) and ``skip`` (glob patterns of model keys this source does not set)."""

    path: Path
    rename: Mapping[str, str] = field(default_factory=dict)
    skip: Sequence[str] = ()


InitFrom = Path | str | InitSource | Sequence[Path | str | InitSource]
"""What ``init_from`` accepts: one source, or several that together set the model's weights."""


def init_sources(init_from: InitFrom) -> list[InitSource]:
    """``init_from`` as a list of sources."""
    items = [init_from] if isinstance(init_from, (Path, str, InitSource)) else list(init_from)
    if not items:
        raise InitialWeightsError("init_from is an empty list. Give at least one source.")
    return [item if isinstance(item, InitSource) else InitSource(Path(item)) for item in items]


@final
@dataclass(frozen=True)
class InitialWeights:
    """What :func:`load_initial_weights` loaded: the sources and the model keys it set."""

    sources: tuple[Path, ...]
    loaded_keys: tuple[str, ...]
    skipped_keys: tuple[str, ...]

    @property
    def source(self) -> Path:
        """The first source (the only one, usually)."""
        return self.sources[0]


def load_initial_weights(
    model: Module,
    init_from: InitFrom,
    *,
    gangs: Gangs,
    rename: Mapping[str, str] | None = None,
    skip: Sequence[str] = (),
) -> InitialWeights:
    """Load the weights of ``init_from`` into ``model`` (DDP, FSDP2, TP or none); every rank
    calls it. ``rename`` and ``skip`` apply to a source given as a plain path.

    With one source, every model key must come from it unless skipped. With several, each sets
    the keys it has (after its renames and skips): a key two sources set, a source key the model
    lacks, and a model key no source sets (and no source skips) are errors.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sources = init_sources(init_from)
    if rename or skip:
        if len(sources) > 1 or isinstance(init_from, InitSource):
            raise InitialWeightsError(
                "rename and skip apply to init_from given as one path; give each source its own "
                "as InitSource(path, rename={...}, skip=[...])."
            )
        sources = [InitSource(sources[0].path, rename or {}, skip)]
    model_state = get_model_state_dict(model)
    ties = tied_keys(model)
    loaded: dict[str, Path] = {}
    paths = []
    for source in sources:
        path, source_keys, loader = _open_source(Path(source.path), gangs, model, model_state)
        plan = _match_keys(
            path,
            source_keys,
            model_state,
            source.rename,
            source.skip,
            whole=len(sources) == 1,
            ties=ties,
            # A pipeline stage's part holds some of the model: the source's other keys are the
            # other stages'.
            part=gangs.pp.size > 1,
        )
        twice = sorted(loaded.keys() & plan.sources.keys())
        if twice:
            raise InitialWeightsError(
                f"{_listed('model', twice)} come from both {loaded[twice[0]]} and {path}. Skip "
                "them in one of the two sources (InitSource(path, skip=[...]))."
            )
        loader({src: _tensor(model_state[target]) for target, src in plan.sources.items()})
        loaded.update(dict.fromkeys(plan.sources, path))
        paths.append(path)
    _copy_to_tied(model_state, ties, loaded)
    skipped = [key for key in model_state if key not in loaded]
    if len(sources) > 1:
        _check_covered(skipped, sources)
    set_model_state_dict(model, model_state)
    log.info(
        "Initialized %d model tensors from %s (%d skipped).",
        len(loaded),
        ", ".join(map(str, paths)),
        len(skipped),
    )
    return InitialWeights(
        sources=tuple(paths), loaded_keys=tuple(loaded), skipped_keys=tuple(skipped)
    )


def _from_tie_mates(
    by_model_key: Mapping[str, str], known: set[str], ties: Sequence[tuple[str, ...]]
) -> dict[str, str]:
    """The source key that sets a tie the model holds under none of the names the source stores
    it by: a pipeline part's copy (``lm_head.weight`` on the last stage) of a weight the source
    stores once (``model.embed_tokens.weight``). A tie the source sets under a name the model
    holds needs none: :func:`_copy_to_tied` gives its other names the value."""
    found = {}
    for names in ties:
        held = [name for name in names if name in known]
        stored = [by_model_key[name] for name in names if name in by_model_key]
        if held and stored and not any(name in by_model_key for name in held):
            found[held[0]] = stored[0]
    return found


def tied_keys(model: Module) -> list[tuple[str, ...]]:
    """The state-dict keys of ``model`` that name one shared parameter (tied embeddings), by
    group: a source may store such a parameter once, under any of its names."""
    ties = [
        tuple(canonical_name(name) for name in tie.names)
        for tie in shared_parameters(unwrap_model(model))
    ]
    # A pipeline part may hold one name of a tie whose other holder is on another rank, which
    # keeps its copy equal to this one: a source that stores the other name sets both.
    return ties + split_ties(model)


def _copy_to_tied(
    model_state: Mapping[str, Any], ties: Sequence[tuple[str, ...]], loaded: dict[str, Path]
) -> None:
    """Give each name of a shared parameter that no source set the value loaded under another
    of its names: the state dict may hold each name as a tensor of its own."""
    with torch.no_grad():
        for names in ties:
            source = next((name for name in names if name in loaded), None)
            if source is None:
                continue
            for name in names:
                if name not in loaded and name in model_state:
                    _tensor(model_state[name]).copy_(_tensor(model_state[source]))
                    loaded[name] = loaded[source]


def _open_source(
    path: Path, gangs: Gangs, model: Module, model_state: Mapping[str, object]
) -> tuple[Path, list[str], _Loader]:
    if path.is_file():
        return path, *_file_source(path)
    if _is_hf_model_dir(path):
        return path, *_hf_model_source(path, model, model_state)
    if path.is_dir():
        path = find_step_dir(path)
        return path, *_dcp_source(path, gangs)
    raise InitialWeightsError(
        f"init_from must be an exported weights file or a checkpoint directory, but {path} "
        "does not exist."
    )


def _check_covered(unset: Sequence[str], sources: Sequence[InitSource]) -> None:
    def skipped(key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) for source in sources for p in source.skip)

    missing = [key for key in unset if not skipped(key)]
    if missing:
        raise InitialWeightsError(
            f"No source of init_from sets {_listed('model', missing)}. Add a source that has "
            "them, or skip them (InitSource(path, skip=[...])) to keep their initialization."
        )


# ---------------------------------------------------------------------------------- sources


class _Loader(ABC):
    """Fills ``{source key: model tensor}`` in place with this rank's part of each source tensor."""

    @abstractmethod
    def __call__(self, targets: dict[str, Tensor]) -> None: ...


@final
class _FileLoader(_Loader):
    def __init__(self, path: Path, state: Mapping[str, Tensor]) -> None:
        self._path = path
        self._state = state

    def __call__(self, targets: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for key, target in targets.items():
                try:
                    source = self._state[key]
                except ConversionError as ex:
                    raise InitialWeightsError(f"{self._path}: {ex}") from ex
                if tuple(source.shape) != tuple(target.shape):
                    raise InitialWeightsError(
                        f"'{key}' in {self._path} has the shape {tuple(source.shape)}, but the "
                        f"model's has {tuple(target.shape)}. Skip it (skip=['{key}']) or fix "
                        "the model's configuration."
                    )
                copy_own_slice(target, source)


@final
class _DcpLoader(_Loader):
    def __init__(self, path: Path, gangs: Gangs) -> None:
        self._path = path
        self._gangs = gangs

    def __call__(self, targets: dict[str, Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict_loader import load

        from checkpoint.dcp_io import SafeLoadPlanner, safe_reader

        # DCP's own reader and planner unpickle its metadata and non-tensor entries with plain
        # pickle; an init_from directory may come from anywhere.
        safe = {"storage_reader": safe_reader(self._path), "planner": SafeLoadPlanner()}
        if self._gangs.root.size == 1:
            load(targets, no_dist=True, **safe)
        else:
            load(targets, process_group=self._gangs.root.as_process_group(), **safe)


def read_weights(path: Path) -> Mapping[str, Tensor]:
    """The tensors of the source ``path`` by name, in one process: a weights file or a Hugging
    Face model directory (each tensor read when it is asked for), or a checkpoint (whole)."""
    from checkpoint.dcp_io import load_whole

    if path.is_file():
        return _file_state(path)
    if _is_hf_model_dir(path):
        return _SafetensorsFiles(_hf_files_by_key(path))
    if path.is_dir():
        state = load_whole(find_step_dir(path) / "model")
        return {key: value for key, value in state.items() if isinstance(value, Tensor)}
    raise InitialWeightsError(
        f"{path} does not exist: give a weights file, a Hugging Face model directory or a "
        "checkpoint directory."
    )


def _file_source(path: Path) -> tuple[list[str], _Loader]:
    tensors = _file_state(path)
    return list(tensors), _FileLoader(path, tensors)


def _file_state(path: Path) -> Mapping[str, Tensor]:
    state: Mapping[str, Tensor]
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise InitialWeightsError(
                f"{path} is a safetensors file, but the safetensors package is not installed. "
                "Install it (pip install safetensors) or use the .pt file export writes."
            ) from None
        state = load_file(path)
    else:
        loaded: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(loaded, Mapping):
            raise InitialWeightsError(
                f"{path} holds a {type(loaded).__name__}, not a state dict of tensors; give a "
                "file written by `python -m runtime export`."
            )
        state = loaded
    return {key: value for key, value in state.items() if isinstance(value, Tensor)}


_HF_INDEX = "model.safetensors.index.json"
_HF_SINGLE = "model.safetensors"


def _is_hf_model_dir(path: Path) -> bool:
    return path.is_dir() and ((path / _HF_INDEX).is_file() or (path / _HF_SINGLE).is_file())


@final
class _SafetensorsFiles(Mapping[str, Tensor]):
    """The tensors of one or more safetensors files by name, each read when it is asked for, so
    that a rank holds one full tensor at a time however large the model."""

    def __init__(self, files_by_key: Mapping[str, Path]) -> None:
        from safetensors import safe_open  # type: ignore[import-not-found,unused-ignore]

        self._files_by_key = dict(files_by_key)
        self._open = {
            file: safe_open(str(file), framework="pt", device="cpu")
            for file in set(self._files_by_key.values())
        }

    def __getitem__(self, key: str) -> Tensor:
        tensor: Tensor = self._open[self._files_by_key[key]].get_tensor(key)  # type: ignore[no-untyped-call,unused-ignore]
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files_by_key)

    def __len__(self) -> int:
        return len(self._files_by_key)


def _hf_model_source(
    path: Path, model: Module, model_state: Mapping[str, object]
) -> tuple[list[str], _Loader]:
    """A Hugging Face directory's tensors under the model's names: a ``transformers`` model's
    per-expert keys merged into its stacked experts (and renamed) as ``from_pretrained`` does."""
    files: Mapping[str, Tensor] = _SafetensorsFiles(_hf_files_by_key(path))
    unwrapped = unwrap_model(model)
    if weight_conversions(unwrapped):
        files = ConvertedCheckpoint(files, unwrapped, model_state)
    return list(files), _FileLoader(path, files)


def _hf_files_by_key(path: Path) -> dict[str, Path]:
    import json

    if (path / _HF_INDEX).is_file():
        weight_map = json.loads((path / _HF_INDEX).read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    from safetensors import safe_open

    with safe_open(str(path / _HF_SINGLE), framework="pt", device="cpu") as file:
        return {key: path / _HF_SINGLE for key in file.keys()}  # noqa: SIM118


def find_step_dir(path: Path) -> Path:
    """The ``step_N`` directory ``path`` names: itself, or the last checkpoint under it (a
    Hugging Face model directory stays itself)."""
    if (path / "model").is_dir() or _is_hf_model_dir(path):
        return path
    checkpoint_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    manager = CheckpointManager(checkpoint_dir, Gangs.single())
    try:
        step_nr = manager.select_checkpoint("last", lower_better=True)
    except CheckpointError as ex:
        raise InitialWeightsError(
            f"init_from {path} is a directory but holds no checkpoint to start from: {ex} Give a "
            "run directory, its checkpoints/ directory or a step_N directory."
        ) from ex
    return checkpoint_dir / f"step_{step_nr}"


def _dcp_source(path: Path, gangs: Gangs) -> tuple[list[str], _Loader]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    metadata = FileSystemReader(path / "model").read_metadata()
    return list(metadata.state_dict_metadata), _DcpLoader(path / "model", gangs)


# ------------------------------------------------------------------------------ key matching


@final
@dataclass(frozen=True)
class _KeyPlan:
    sources: dict[str, str]
    """Model key -> source key, for every model key that is loaded."""
    skipped: list[str]


def _match_keys(
    path: Path,
    source_keys: Iterable[str],
    model_keys: Iterable[str],
    rename: Mapping[str, str],
    skip: Sequence[str],
    *,
    whole: bool = True,
    ties: Sequence[tuple[str, ...]] = (),
    part: bool = False,
) -> _KeyPlan:
    """Which model key each source key sets. ``whole``: every model key must be set or skipped
    (one source); otherwise the source may set part of the model. A key of a shared parameter
    (``ties``) that the source stores under another of its names is not missing. ``part``: the
    model is part of the source's (a pipeline stage's), so keys it lacks are not unexpected."""

    def skipped(key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in skip)

    by_model_key = {_renamed(key, rename): key for key in source_keys}
    stored_once = {key for names in ties if any(n in by_model_key for n in names) for key in names}
    model_keys = list(model_keys)
    known = set(model_keys)
    by_model_key.update(_from_tie_mates(by_model_key, known, ties))
    missing = (
        [k for k in model_keys if k not in by_model_key and k not in stored_once and not skipped(k)]
        if whole
        else []
    )
    unexpected = [] if part else [k for k in by_model_key if k not in known and not skipped(k)]
    if missing or unexpected:
        raise InitialWeightsError(
            f"The weights in {path} do not match the model: "
            f"{_listed('missing', missing)}; {_listed('unexpected', unexpected)}. "
            "Map source names to the model's with rename={'old.prefix.': 'new.prefix.'}, or "
            "leave keys out with skip=['pattern.*']."
        )
    loaded = {k: by_model_key[k] for k in model_keys if k in by_model_key and not skipped(k)}
    return _KeyPlan(sources=loaded, skipped=[k for k in model_keys if k not in loaded])


def _tensor(value: object) -> Tensor:
    assert isinstance(value, Tensor), type(value)
    return value


def _renamed(key: str, rename: Mapping[str, str]) -> str:
    for old, new in rename.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _listed(what: str, keys: list[str]) -> str:
    if not keys:
        return f"no {what} keys"
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    more = f" and {len(keys) - _MAX_LISTED_KEYS} more" if len(keys) > _MAX_LISTED_KEYS else ""
    return f"{len(keys)} {what} key{'s' if len(keys) > 1 else ''} ({shown}{more})"
