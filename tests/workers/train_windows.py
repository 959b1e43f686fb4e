"""A toy training run on windows of data, under ``torchrun`` or in the test process.

Usage: ``train_windows.py OUTPUT_DIR JSON_OPTIONS``. Options: ``root`` (the window directory),
``max_num_steps``, ``checkpoint_every_windows``, ``reference`` (first train the whole stream in
``OUTPUT_DIR/reference``, from scratch), ``late_window`` and ``late_after_epoch`` (the last rank
marks that window ready, then writes the stop marker, when that data epoch runs out: rank 0 may
look before or after). Each run writes ``report_rank_R.json`` (the steps' windows and example ids, the epoch
hooks, the stop reason) and rank 0 writes ``params.pt``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import Trainer, TrainerCallback, WindowedDataReader, apply_data_parallel
from runtime.data import load_window_files
from runtime.data.windows import mark_ready, mark_stopped
from tests.workers.leave import leave
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate

POOL_SIZE = 256


@cache
def toy_pool() -> ToyDataset:
    return ToyDataset(POOL_SIZE)


@dataclass
class IdToyBatch(ToyBatch):
    ids: list[int] = field(default_factory=list)


def collate_with_ids(examples: list[dict[str, Any]]) -> IdToyBatch:
    batch = collate(examples)
    return IdToyBatch(
        batch.x, batch.y, batch.mask, batch.num_targets, ids=[e["id"] for e in examples]
    )


def load_ids(path: Path) -> list[dict[str, Any]]:
    pool = toy_pool()
    return [{**pool[i], "id": i} for i in json.loads(path.read_text())]


load_toy_window = load_window_files(load_ids, pattern="*.json")


def write_window(root: Path, name: str, ids: Sequence[int], *, ready: bool = True) -> None:
    window = root / name
    window.mkdir(parents=True, exist_ok=True)
    (window / "ids.json").write_text(json.dumps(list(ids)))
    if ready:
        mark_ready(window)


class Recorder(TrainerCallback):
    """Keeps the epoch hooks and each step's window and example ids, as plain values."""

    def __init__(self, reader: WindowedDataReader[IdToyBatch]) -> None:
        self.reader = reader
        self.events: list[list[Any]] = []
        self.steps: list[dict[str, Any]] = []

    def on_epoch_begin(self, *, epoch_nr: int, step_nr: int) -> None:
        self.events.append(["epoch_begin", epoch_nr, step_nr])

    def on_out_of_data(self, *, step_nr: int, epoch_nr: int) -> None:
        self.events.append(["out_of_data", epoch_nr, step_nr])

    def on_epoch_end(self, *, epoch_nr: int, step_nr: int) -> None:
        self.events.append(["epoch_end", epoch_nr, step_nr])

    def on_checkpoint_saved(self, *, step_nr: int, checkpoint_dir: Path | None) -> None:
        self.events.append(["checkpoint", step_nr])

    def on_train_end(self, *, step_nr: int) -> None:
        self.events.append(["train_end", step_nr])

    def on_step_begin(self, *, step_nr: int, batches: Sequence[Any]) -> None:
        ids = [i for batch in batches for i in batch.ids]
        self.steps.append({"step": step_nr, "window": self.reader.window, "ids": ids})


class MarkLateWindow(TrainerCallback):
    """Marks ``window`` ready, then stops the stream, when data epoch ``after_epoch`` runs out."""

    def __init__(self, root: Path, window: str, after_epoch: int) -> None:
        self._root = root
        self._window = window
        self._after_epoch = after_epoch

    def on_out_of_data(self, *, step_nr: int, epoch_nr: int) -> None:
        window = self._root / self._window
        if epoch_nr == self._after_epoch and not (window / "_SUCCESS").exists():
            mark_ready(window)
            mark_stopped(self._root)


def make_trainer(
    output_dir: Path, gangs: Gangs, options: dict[str, Any], callbacks: Sequence[TrainerCallback]
) -> tuple[Trainer[IdToyBatch], Recorder, nn.Module]:
    torch.manual_seed(0)
    model: nn.Module = ToyModel()
    if gangs.root.size > 1:
        model = apply_data_parallel(model, gangs, kind="ddp")
    reader = WindowedDataReader(
        root=options["root"],
        load_window=load_toy_window,
        batch_size=options.get("batch_size", 2),
        collate=collate_with_ids,
        gang=gangs.dp,
        root_gang=gangs.root,
        seed=3,
        max_num_windows=options.get("max_num_windows"),
        wait_timeout=options.get("wait_timeout", 60.0),
        poll_interval=0.02,
    )
    recorder = Recorder(reader)
    callbacks = [recorder, *callbacks]
    late = options.get("late_window")
    if late is not None and gangs.root.rank == gangs.root.size - 1:
        callbacks.append(MarkLateWindow(Path(options["root"]), late, options["late_after_epoch"]))
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=reader,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=options.get("max_num_steps"),
        checkpoint_every_n_data_epochs=options.get("checkpoint_every_windows"),
        callbacks=callbacks,
        progress=False,
    )
    return trainer, recorder, model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {k.removeprefix("module."): v.detach().clone() for k, v in state.items()}


def train(
    output_dir: Path,
    gangs: Gangs,
    options: dict[str, Any],
    callbacks: Sequence[TrainerCallback] = (),
) -> Trainer[IdToyBatch]:
    """One launch of the run in ``output_dir``: train, then write the report and parameters."""
    output_dir.mkdir(parents=True, exist_ok=True)
    trainer, recorder, model = make_trainer(output_dir, gangs, options, callbacks)
    exit_code = trainer.run()
    reason = trainer._loop.state.stop_reason
    report = {
        "exit_code": exit_code,
        "stop_reason": None if reason is None else reason.value,
        "events": recorder.events,
        "steps": recorder.steps,
    }
    rank = gangs.root.rank
    (output_dir / f"report_rank_{rank}.json").write_text(json.dumps(report))
    params = full_params(model)
    if rank == 0:
        torch.save(params, output_dir / "params.pt")
    return trainer


def main(output_dir: Path, options: dict[str, Any]) -> None:
    gangs = setup_gangs()
    trainers = []
    if options.get("reference"):
        trainers.append(train(output_dir / "reference", gangs, {**options, "max_num_steps": None}))
    trainers.append(train(output_dir / "run", gangs, options))
    leave(gangs.root, *trainers)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
