"""Reload weights from other runs while training (a model bank kept fresh by its producers).

:class:`ReloadInitialWeights` is a callback: every ``every_n_steps`` steps, after the optimizer
step, every rank loads the ``init_from`` sources into the model at the same step (the optimizer
state stays). Another run may export into a source while this one reads it: rank 0 pins what
each source is (the last checkpoint of a directory, the size and modification time of a file),
every rank loads exactly that, and if a file changed under a rank's read, all ranks read again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.nn import Module

from gangs import Gangs
from runtime.metrics.recorders import MetricRecorder
from runtime.training.initial_weights import (
    InitFrom,
    InitialWeightsError,
    InitSource,
    find_step_dir,
    init_sources,
    load_initial_weights,
)
from trainkit_utils.arguments import check_positive
from units.callback import TrainerCallback

log = logging.getLogger(__name__)

_MAX_TRIES = 5


class ReloadInitialWeights(TrainerCallback):
    """Load ``init_from`` into ``model`` after every ``every_n_steps``-th step, or at the end of
    every ``every_n_data_epochs``-th data epoch (give one or both).

    Each reload is logged and recorded as the run ``init_reload`` (``num_reloads``,
    ``num_tensors``) by ``recorders``; the count of reloads is checkpointed with the callback.
    """

    def __init__(
        self,
        model: Module,
        init_from: InitFrom,
        *,
        gangs: Gangs,
        every_n_steps: int | None = None,
        every_n_data_epochs: int | None = None,
        recorders: Sequence[MetricRecorder] = (),
    ) -> None:
        if every_n_steps is None and every_n_data_epochs is None:
            raise ValueError(
                "ReloadInitialWeights needs every_n_steps or every_n_data_epochs (or both), but "
                "neither is given."
            )
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_n_data_epochs", every_n_data_epochs),
        ):
            if value is not None:
                check_positive(name, value)
        self._model = model
        self._sources = init_sources(init_from)
        self._gangs = gangs
        self._every_n_steps = every_n_steps
        self._every_n_data_epochs = every_n_data_epochs
        self._recorders = list(recorders)
        self._versions: list[tuple[int, int] | None] = []
        self.num_reloads = 0

    def on_step_end(self, *, step_nr: int, **_: Any) -> None:
        if self._every_n_steps is not None and step_nr % self._every_n_steps == 0:
            self.reload(step_nr)

    def on_epoch_end(self, *, epoch_nr: int, step_nr: int) -> None:
        every = self._every_n_data_epochs
        if every is not None and epoch_nr % every == 0:
            self.reload(step_nr)

    def reload(self, step_nr: int) -> None:
        """Load the sources now; every rank must call it at the same step."""
        for attempt in range(1, _MAX_TRIES + 1):
            pinned = self._pin_sources()
            loaded = load_initial_weights(self._model, pinned, gangs=self._gangs)
            changed = any(
                _version(s.path) != v for s, v in zip(pinned, self._versions, strict=True)
            )
            if not any(self._gangs.root.all_gather_objects(changed)):
                break
            if attempt == _MAX_TRIES:
                raise InitialWeightsError(
                    f"The init_from sources changed during each of {_MAX_TRIES} reloads at step "
                    f"{step_nr}. Write exports under a temporary name and rename them."
                )
            log.warning("An init_from source changed while it was read; reading it again.")
            time.sleep(0.5 * attempt)
        self.num_reloads += 1
        log.info(
            "Reloaded %d model tensors from %s at step %d.",
            len(loaded.loaded_keys),
            ", ".join(map(str, loaded.sources)),
            step_nr,
        )
        values = {"num_reloads": self.num_reloads, "num_tensors": len(loaded.loaded_keys)}
        for recorder in self._recorders:
            recorder.record("init_reload", step_nr, values)

    def _pin_sources(self) -> list[InitSource]:
        """Rank 0's view of the sources, the same on every rank: a checkpoint directory becomes
        its last ``step_N``, and a file's version is its size and modification time."""
        pinned: list[Any] = [None]
        if self._gangs.root.rank == 0:
            paths = [
                find_step_dir(Path(s.path)) if Path(s.path).is_dir() else Path(s.path)
                for s in self._sources
            ]
            pinned = [[(str(path), _version(path)) for path in paths]]
        self._gangs.root.broadcast_objects(pinned)
        self._versions = [version for _, version in pinned[0]]
        return [
            InitSource(Path(path), source.rename, source.skip)
            for (path, _), source in zip(pinned[0], self._sources, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"num_reloads": self.num_reloads}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.num_reloads = int(state["num_reloads"])


def _version(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time; None for a directory (a committed checkpoint does
    not change)."""
    if path.is_dir():
        return None
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
