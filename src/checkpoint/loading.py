"""Loading checkpoints: each rank hashes its share as DCP reads it, the ranks agree on the
verdict, a resume falls back past damaged checkpoints, and another world layout reshards.

The loads of :class:`~checkpoint.manager.CheckpointManager`; see :mod:`checkpoint.manager` for
what a damaged checkpoint becomes and :mod:`checkpoint.manifest` for the verification.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, final

import torch
from torch.nn import Module
from torch.optim import Optimizer

from checkpoint import directory, health
from checkpoint.base import LoadedCheckpoint
from checkpoint.errors import (
    CheckpointError,
    CheckpointLayoutError,
    CheckpointLoadError,
    caused_by_the_machine,
    on_all_ranks,
)
from checkpoint.exclusion import pop_entries
from checkpoint.layout import WorldLayout, needs_reshard
from checkpoint.manifest import LoadCheck, resume_candidates, verify_share
from checkpoint.storage import (
    DcpStorage,
    get_model_state,
    get_state_dicts,
    set_model_state,
    set_state_dicts,
)
from gangs import Gang, Gangs, agree
from trainkit_utils.modules import split_ties

log = logging.getLogger(__name__)

T = TypeVar("T")


@final
class CheckpointLoader:
    """Loads the checkpoints of ``checkpoint_dir`` through ``storage``; every rank of
    ``gangs.root`` must make the same calls."""

    def __init__(self, checkpoint_dir: Path, gangs: Gangs, storage: DcpStorage) -> None:
        self._dir = checkpoint_dir
        self._gangs = gangs
        self._root = gangs.root
        self._storage = storage

    def load_last(
        self, *, model: Module, optimizer: Optimizer | Sequence[Optimizer], reshard: bool
    ) -> LoadedCheckpoint | None:
        """See :meth:`CheckpointManager.load_last_checkpoint`."""
        candidates = resume_candidates(self._dir)
        damaged: list[int] = []
        for step_nr in reversed(candidates):
            try:
                loaded = self.load(step_nr, model=model, optimizer=optimizer, reshard=reshard)
            except (CheckpointLayoutError, CheckpointLoadError):
                raise
            except CheckpointError as ex:
                log.warning(
                    "Skipping the checkpoint of step %d, which is damaged, and falling back to "
                    "the one before it: %s",
                    step_nr,
                    ex,
                )
                damaged.append(step_nr)
                continue
            if damaged:
                _move_aside(self._root, self._dir, damaged)
                log.warning(
                    "Resumed from the checkpoint of step %d instead of the damaged one of step %d.",
                    step_nr,
                    damaged[0],
                )
            health.log_passed_over(self._dir, step_nr)
            return loaded
        if candidates:
            raise CheckpointError(
                f"None of the checkpoints in {self._dir} (steps {candidates}) is intact. "
                "Move the directory away to start from scratch."
            )
        health.check_not_all_unhealthy(self._dir)
        return None

    def load(
        self,
        step_nr: int,
        *,
        model: Module,
        optimizer: Optimizer | Sequence[Optimizer],
        reshard: bool,
    ) -> LoadedCheckpoint:
        """See :meth:`CheckpointManager.load_checkpoint`."""
        path = directory.step_dir(self._dir, step_nr)
        check = self.verdict(
            f"check the checkpoint of step {step_nr}",
            lambda: LoadCheck(path, step_nr, rank=self._root.rank, world_size=self._root.size),
        )
        manifest = check.manifest
        if manifest["kind"] != "full":
            raise CheckpointError(
                f"The checkpoint of step {step_nr} holds only the model (its optimizer and "
                "trainer state were pruned by retention), so training cannot resume from it."
            )
        resharded = needs_reshard(
            WorldLayout.of_manifest(manifest),
            WorldLayout.of(self._gangs, model),
            step_dir=path,
            step_nr=step_nr,
            reshard=reshard,
        )

        model_state, optim_state = get_state_dicts(model, optimizer)
        # What the checkpoint left out keeps the model's own values.
        kept = pop_entries(model_state, manifest.get("excluded", []))
        own_names = [list(group["params"]) for group in optim_state.get("param_groups", [])]
        aliases = _tie_aliases(model, optim_state)
        _rename_state(optim_state, aliases)
        rank_file = "rank_0.pt" if resharded else f"rank_{self._root.rank}.pt"
        trainer_file = path / "trainer" / rank_file
        try:
            for subdir, state in (("model", model_state), ("optimizer", optim_state)):
                load = partial(self._storage.load, state, path / subdir, check.reads(subdir))
                on_all_ranks(self._root, f"load the {subdir}", load)
            trainer_state = on_all_ranks(
                self._root,
                "load the trainer state",
                lambda: torch.load(trainer_file, weights_only=True),
            )
        except CheckpointError as ex:
            self.verify(step_nr)  # a damaged file that failed to load, named by its digest
            _raise_if_the_machine_failed(self._root, step_nr, ex)
            raise
        # The digests: a damaged file (of the right size) has loaded by now; see checkpoint.manifest.
        self.verdict(f"verify the checkpoint of step {step_nr}", check.finish)
        _keep_own_parameter_names(optim_state, own_names)
        _rename_state(optim_state, {first: held for held, first in aliases.items()})
        set_state_dicts(model, optimizer, {**model_state, **kept}, optim_state)
        log.info("Loaded the checkpoint of step %d from %s.", step_nr, path)
        return LoadedCheckpoint(
            step_nr=step_nr, trainer_state=trainer_state, manifest=manifest, resharded=resharded
        )

    def load_model(self, step_nr: int, *, model: Module) -> None:
        """See :meth:`CheckpointManager.load_model`."""
        path = directory.step_dir(self._dir, step_nr)
        manifest = self.verify(step_nr)
        state = get_model_state(model)
        kept = pop_entries(state, manifest.get("excluded", []))
        on_all_ranks(
            self._root, "load the model", lambda: self._storage.load(state, path / "model")
        )
        set_model_state(model, {**state, **kept})

    def verify(self, step_nr: int) -> dict[str, Any]:
        """See :meth:`CheckpointManager.verify`."""
        path = directory.step_dir(self._dir, step_nr)
        return self.verdict(
            f"verify the checkpoint of step {step_nr}",
            lambda: verify_share(path, step_nr, rank=self._root.rank, world_size=self._root.size),
        )

    def verdict(self, what: str, action: Callable[[], T]) -> T:
        """:func:`~checkpoint.errors.on_all_ranks`, but one process raises the error as it is,
        without a rank prefix."""
        if self._root.size == 1:
            return action()
        return on_all_ranks(self._root, what, action)


def _move_aside(root: Gang, checkpoint_dir: Path, step_nrs: list[int]) -> None:
    """Rank 0 moves the damaged checkpoints of ``step_nrs`` aside; every rank waits for it."""
    if root.rank == 0:
        for step_nr in step_nrs:
            target = directory.move_aside(directory.step_dir(checkpoint_dir, step_nr))
            log.warning(
                "Moved the damaged checkpoint of step %d to %s; delete it once you no longer "
                "need it for inspection.",
                step_nr,
                target,
            )
    root.barrier()


def _raise_if_the_machine_failed(root: Gang, step_nr: int, error: CheckpointError) -> None:
    """Raise CheckpointLoadError on every rank if the intact checkpoint of ``step_nr`` failed
    to load on some rank for a reason of the machine: falling back to an older checkpoint
    would give up its steps for nothing."""
    machine_failed, _ = agree(root, failed=caused_by_the_machine(error))
    if machine_failed:
        raise CheckpointLoadError(
            f"The checkpoint of step {step_nr} is intact (every file matches its digest), but "
            f"loading it failed ({error}). That is not damage, so the run does not fall back "
            "to an older checkpoint: fix the cause (memory, the installation, the filesystem) "
            "and resume again."
        ) from error


def _tie_aliases(model: Module, optim_state: dict[str, Any]) -> dict[str, str]:
    """The optimizer state names of this rank's copies of tied weights whose first name is
    another rank's (a pipeline's last stage holds ``lm_head.weight``, the first stage
    ``model.embed_tokens.weight``), each with that first name. Every checkpoint holds the state
    under the first name (one process names a tied weight's state by it), and the copies are
    equal, so a copy reads the state stored under it."""
    state = optim_state.get("state", {})
    aliases = {}
    for names in split_ties(model):
        held = [name for name in names if name in state]
        if held and names[0] not in state:
            aliases[held[0]] = names[0]
    return aliases


def _rename_state(optim_state: dict[str, Any], names: dict[str, str]) -> None:
    """Move the optimizer state of each key of ``names`` to its value."""
    state = optim_state.get("state", {})
    for old, new in names.items():
        state[new] = state.pop(old)


def _keep_own_parameter_names(optim_state: dict[str, Any], own_names: list[list[str]]) -> None:
    """Give each loaded param group the names of this rank's parameters.

    DCP keeps one copy of what is not a tensor: every rank reads the param groups of the rank
    that wrote them, hyperparameters and parameter names. Under pipeline parallelism each rank's
    groups hold other parameters (its stages'), and a group whose names are all another rank's
    would load without its hyperparameters. The hyperparameters are the same on every rank; the
    names stay this rank's own. Where the number of groups differs, the loaded ones stand.
    """
    groups = optim_state.get("param_groups", [])
    if len(groups) != len(own_names):
        return
    for group, names in zip(groups, own_names, strict=True):
        group["params"] = names
