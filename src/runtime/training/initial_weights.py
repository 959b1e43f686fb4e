"""Start a model from weights: an exported file or another run's checkpoint, any layout.

The source is one of:

- a file written by ``python -m runtime export`` (``torch.load`` format, read memory-mapped so
  each rank pages in only the slices it keeps), or a ``.safetensors`` file;
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, final

import torch
from torch import Tensor
from torch.nn import Module

from checkpoint import CheckpointError, CheckpointManager
from gangs import Gangs
from runtime.parallel.materialize import copy_own_slice

log = logging.getLogger(__name__)

_MAX_LISTED_KEYS = 10


class InitialWeightsError(ValueError):
    """The initial weights cannot be loaded into the model (missing or unexpected keys, shapes)."""


@final
@dataclass(frozen=True)
class InitialWeights:
    """What :func:`load_initial_weights` loaded: the source and the model keys it set."""

    source: Path
    loaded_keys: tuple[str, ...]
    skipped_keys: tuple[str, ...]


def load_initial_weights(
    model: Module,
    path: Path,
    *,
    gangs: Gangs,
    rename: Mapping[str, str] | None = None,
    skip: Sequence[str] = (),
) -> InitialWeights:
    """Load the weights at ``path`` into ``model`` (DDP, FSDP2, TP or none); every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    model_state = get_model_state_dict(model)
    if path.is_file():
        source_keys, loader = _file_source(path)
    elif path.is_dir():
        path = _step_dir(path)
        source_keys, loader = _dcp_source(path, gangs)
    else:
        raise InitialWeightsError(
            f"init_from must be an exported weights file or a checkpoint directory, but {path} "
            "does not exist."
        )
    plan = _match_keys(path, source_keys, model_state.keys(), rename or {}, skip)
    loader({source: _tensor(model_state[target]) for target, source in plan.sources.items()})
    set_model_state_dict(model, model_state)
    log.info(
        "Initialized %d model tensors from %s (%d skipped).",
        len(plan.sources),
        path,
        len(plan.skipped),
    )
    return InitialWeights(
        source=path, loaded_keys=tuple(plan.sources), skipped_keys=tuple(plan.skipped)
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
                source = self._state[key]
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


def _file_source(path: Path) -> tuple[list[str], _Loader]:
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
    tensors = {key: value for key, value in state.items() if isinstance(value, Tensor)}
    return list(tensors), _FileLoader(path, tensors)


def _step_dir(path: Path) -> Path:
    """The ``step_N`` directory ``path`` names: itself, or the last checkpoint under it."""
    if (path / "model").is_dir():
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
) -> _KeyPlan:
    def skipped(key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in skip)

    by_model_key = {_renamed(key, rename): key for key in source_keys}
    model_keys = list(model_keys)
    known = set(model_keys)
    missing = [k for k in model_keys if k not in by_model_key and not skipped(k)]
    unexpected = [k for k in by_model_key if k not in known and not skipped(k)]
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
