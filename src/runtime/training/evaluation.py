"""Running eval units over their data: the Trainer's validation and standalone evaluation."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import torch
from torch.nn import Module

from checkpoint import AbstractCheckpointManager, CheckpointChoice
from gangs import Gang, Gangs
from runtime.data import DataReader
from runtime.metrics.recorders import MetricRecorder
from runtime.training.stand_in import StandInBatch
from trainkit_utils.arguments import check_same_length
from units import EvalUnit

log = logging.getLogger(__name__)

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]
"""Makes the context each eval unit's forward runs in (autocast, or nothing)."""


def run_name(unit: EvalUnit[Any], prefix: str) -> str:
    """``valid`` for an unnamed unit, ``valid/<display_name>`` otherwise."""
    return prefix if unit.display_name is None else f"{prefix}/{unit.display_name}"


def check_run_names(units: Sequence[EvalUnit[Any]]) -> None:
    """Each unit publishes under its own run, so no two units may share a ``display_name``."""
    names = [unit.display_name for unit in units]
    duplicates = sorted({repr(name) for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            "Each eval unit publishes its values under its display_name, so the names must "
            f"differ, but more than one unit has the display_name {' and '.join(duplicates)}."
        )


def evaluate_units(
    *,
    model: Module,
    units: Sequence[EvalUnit[Any]],
    data_readers: Sequence[DataReader[Any]],
    gangs: Gangs,
    step_nr: int,
    recorder: MetricRecorder,
    run_prefix: str = "valid",
    autocast: AutocastFactory = contextlib.nullcontext,
    max_num_steps: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Run each unit over its reader to the end, publish and return the values by run name.

    With ``max_num_steps``, each unit reads at most that many steps of its reader: every rank
    stops after the same number, so the values cover the first ``max_num_steps`` batches of
    every rank's shard.

    Every rank of the DP gang makes the same forwards, whatever its share of the data: a rank
    whose shard ran out (it reads ``[]``) runs the unit on a stand-in batch while the others
    read, and that forward's metric updates are discarded. So under FSDP2, HSDP and TP every
    rank takes part in every collective of the others' forwards, and the values are those of
    one process over the whole set. A unit's ``__call__`` must therefore record only into its
    ``metric_bag``.

    The model is in eval mode under ``torch.no_grad()`` meanwhile, and is put back in the mode
    it was in. Each reader is reset afterwards, ready for the next evaluation.

    Not ``inference_mode``: tensors made under it can never be updated in place outside it, and
    a forward allocates state that training later updates in place (FSDP2's unsharded
    parameter buffers, caches of compiled or user modules), which would then fail at the first
    training step.
    """
    was_training = model.training
    model.eval()
    results: dict[str, dict[str, Any]] = {}
    try:
        with torch.no_grad():
            for unit, reader in zip(units, data_readers, strict=True):
                unit.set_step_nr(step_nr)
                _run_unit(unit, reader, gangs.dp, autocast=autocast, max_num_steps=max_num_steps)
                reader.reset()
                # Over DP x SP: each SP rank scored its part of the sequences.
                values = unit.metric_bag.sync_and_compute(gangs.dp_sp)
                unit.metric_bag.reset_metrics()
                name = run_name(unit, run_prefix)
                recorder.record(name, step_nr, values)
                results[name] = values
    finally:
        model.train(was_training)
        reshard_fsdp_modules(model)
    return results


def _run_unit(
    unit: EvalUnit[Any],
    reader: DataReader[Any],
    dp_gang: Gang,
    *,
    autocast: AutocastFactory = contextlib.nullcontext,
    max_num_steps: int | None = None,
) -> None:
    """Run ``unit`` over ``reader`` to its end (or ``max_num_steps``), in step with every rank.

    Every rank makes ``reader.num_accumulate`` forwards in each step, so under FSDP2, HSDP or
    TP every rank takes part in the collectives of every forward the others make. A rank whose
    step holds fewer micro-batches (its shard ran out, or the epoch's last step is partial)
    makes up the difference with forwards of a stand-in batch, whose metric updates are
    discarded: it contributes nothing to the values.
    """
    stand_in = StandInBatch(dp_gang, num_accumulate=reader.num_accumulate)
    for num_steps, batches in enumerate(reader):
        if max_num_steps is not None and num_steps == max_num_steps:
            break
        stand_in.update(batches)
        for batch in batches:
            with autocast():
                unit(batch)
        for _ in range(stand_in.num_missing(batches)):
            with unit.metric_bag.discarding_updates(), autocast():
                unit(stand_in.batch)


def reshard_fsdp_modules(model: Module) -> None:
    """Free the full parameters that FSDP2 gathered for a forward without a backward.

    FSDP2 keeps the root module's parameters gathered after its forward until the backward,
    which an evaluation never runs: an optimizer built afterwards would then hold the full
    tensors instead of the shards, and the memory would stay taken.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def combine_scores(results: Mapping[str, Mapping[str, Any]], score_metric_name: str) -> float:
    """The mean of the units' ``score_metric_name``: each unit is an equal view of quality.

    Every unit must record ``score_metric_name``; the orientation (``lower_better``) is the
    caller's, applied to the combined score.
    """
    scores = []
    for name, values in results.items():
        if score_metric_name not in values:
            raise ValueError(
                f"score_metric_name is '{score_metric_name}', but the unit of run '{name}' "
                f"records only {sorted(values)}. Pick one of those or record it."
            )
        scores.append(float(values[score_metric_name]))
    return sum(scores) / len(scores)


@final
class Evaluator:
    """Evaluates ``model`` with eval units over their readers, outside of training.

    Values are published as ``<run_prefix>`` (``eval`` by default) for an unnamed unit and
    ``<run_prefix>/<display_name>`` otherwise, with the metric names the units record.
    """

    def __init__(
        self,
        *,
        model: Module,
        units: Sequence[EvalUnit[Any]],
        data_readers: Sequence[DataReader[Any]],
        gangs: Gangs,
        recorder: MetricRecorder,
        run_prefix: str = "eval",
        autocast: AutocastFactory = contextlib.nullcontext,
        max_num_steps: int | None = None,
    ) -> None:
        if not units:
            raise ValueError("units must hold at least one EvalUnit.")
        check_same_length("units", units, "data_readers", data_readers)
        check_run_names(units)
        self._model = model
        self._units = list(units)
        self._data_readers = list(data_readers)
        self._gangs = gangs
        self._recorder = recorder
        self._run_prefix = run_prefix
        self._autocast = autocast
        self._max_num_steps = max_num_steps

    def with_run_prefix(self, run_prefix: str) -> Evaluator:
        """The same evaluation, published under ``run_prefix``."""
        return Evaluator(
            model=self._model,
            units=self._units,
            data_readers=self._data_readers,
            gangs=self._gangs,
            recorder=self._recorder,
            run_prefix=run_prefix,
            autocast=self._autocast,
            max_num_steps=self._max_num_steps,
        )

    def run(self, step_nr: int) -> dict[str, dict[str, Any]]:
        """Evaluate and publish under ``step_nr``; return the values by run name."""
        return evaluate_units(
            model=self._model,
            units=self._units,
            data_readers=self._data_readers,
            gangs=self._gangs,
            step_nr=step_nr,
            recorder=self._recorder,
            run_prefix=self._run_prefix,
            autocast=self._autocast,
            max_num_steps=self._max_num_steps,
        )

    def evaluate_checkpoint(
        self,
        checkpoint_manager: AbstractCheckpointManager,
        which: CheckpointChoice = "last",
        *,
        lower_better: bool = True,
    ) -> dict[str, dict[str, Any]]:
        """Load the model of checkpoint ``which`` into ``model``, evaluate it at its step."""
        step_nr = checkpoint_manager.select_checkpoint(which, lower_better=lower_better)
        checkpoint_manager.load_model(step_nr, model=self._model)
        what = "" if isinstance(which, int) else f" (the {which})"
        log.info("Evaluating the model of the checkpoint of step %d%s.", step_nr, what)
        return self.run(step_nr)
