"""Trainer callbacks: the documented order and arguments, recorded in one process."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from runtime import PREEMPTED_EXIT_CODE, PatienceEarlyStopper, TrainerCallback
from runtime.training.callbacks import CallbackList
from tests.conftest import read_jsonl
from tests.runtime.training.test_validation import make_trainer, scripted

Call = tuple[Any, ...]


class CallRecorder(TrainerCallback):
    """Appends ``(hook, step_nr, ...)`` for each call, and keeps the full arguments aside."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.values: dict[tuple[str, int], Mapping[str, Any]] = {}
        self.results: dict[int, Mapping[str, Mapping[str, Any]]] = {}
        self.scores: dict[int, float | None] = {}
        self.checkpoint_dirs: dict[int, Path] = {}
        self.manifests: dict[int, dict[str, Any]] = {}

    def on_train_begin(self, *, step_nr: int) -> None:
        self.calls.append(("train_begin", step_nr))

    def on_step_end(self, *, step_nr: int) -> None:
        self.calls.append(("step_end", step_nr))

    def on_metrics_published(self, *, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        self.calls.append(("metrics", step_nr, run))
        self.values[run, step_nr] = dict(values)

    def on_validation_end(
        self, *, step_nr: int, score: float | None, results: Mapping[str, Mapping[str, Any]]
    ) -> None:
        self.calls.append(("validation_end", step_nr))
        self.scores[step_nr] = score
        self.results[step_nr] = results

    def on_checkpoint_saved(self, *, step_nr: int, checkpoint_dir: Path) -> None:
        self.calls.append(("checkpoint_saved", step_nr))
        self.checkpoint_dirs[step_nr] = checkpoint_dir
        # Committed by now: the manifest is there to read.
        self.manifests[step_nr] = json.loads((checkpoint_dir / "manifest.json").read_text())

    def on_early_stop(self, *, step_nr: int, score: float) -> None:
        self.calls.append(("early_stop", step_nr, score))

    def on_train_end(self, *, step_nr: int) -> None:
        self.calls.append(("train_end", step_nr))


def test_callbacks_fire_in_the_documented_order(tmp_path: Path) -> None:
    recorder = CallRecorder()
    trainer = make_trainer(
        tmp_path,
        max_num_steps=4,
        publish_metrics_every_n_steps=2,
        validate_every_n_steps=2,
        validate_at_start=True,
        checkpoint_every_n_steps=4,
        score_metric_name="mse",
        lower_better=True,
        early_stopper=lambda step_nr, score: False,
        callbacks=[recorder],
    )
    assert trainer.run() == 0
    assert recorder.calls == [
        ("train_begin", 0),
        ("metrics", 0, "valid"),
        ("validation_end", 0),
        ("step_end", 1),
        ("step_end", 2),
        ("metrics", 2, "train"),
        ("metrics", 2, "valid"),
        ("validation_end", 2),
        ("step_end", 3),
        ("step_end", 4),
        ("metrics", 4, "train"),
        ("metrics", 4, "valid"),
        ("validation_end", 4),
        ("checkpoint_saved", 4),
        ("train_end", 4),
    ]

    # The published values are those written to disk.
    for run in ("train", "valid"):
        for record in read_jsonl(tmp_path / "metrics" / f"{run}.jsonl"):
            step_nr = record.pop("step_nr")
            assert recorder.values[run, step_nr] == pytest.approx(record)
    for step_nr in (0, 2, 4):
        assert recorder.results[step_nr] == {"valid": recorder.values["valid", step_nr]}
        assert recorder.scores[step_nr] == recorder.values["valid", step_nr]["mse"]
    assert recorder.checkpoint_dirs == {4: tmp_path / "checkpoints" / "step_4"}
    assert recorder.manifests[4]["score"] == pytest.approx(recorder.scores[4])


def test_an_early_stop_ends_with_the_final_checkpoint_and_train_end(tmp_path: Path) -> None:
    recorder = CallRecorder()
    trainer = make_trainer(
        tmp_path,
        units=scripted({2: 1.0, 4: 2.0, 6: 3.0}),
        max_num_steps=10,
        publish_metrics_every_n_steps=4,
        validate_every_n_steps=2,
        checkpoint_every_n_steps=4,
        score_metric_name="score",
        lower_better=True,
        early_stopper=PatienceEarlyStopper(2),
        callbacks=[recorder],
    )
    assert trainer.run() == 0
    assert recorder.calls[-9:] == [
        ("checkpoint_saved", 4),
        ("step_end", 5),
        ("step_end", 6),
        ("metrics", 6, "valid"),
        ("validation_end", 6),
        ("early_stop", 6, 3.0),
        ("metrics", 6, "train"),
        ("checkpoint_saved", 6),
        ("train_end", 6),
    ]
    assert recorder.values["train", 6]["num_steps"] == 2


def test_a_data_epoch_end_validates_before_the_next_step(tmp_path: Path) -> None:
    recorder = CallRecorder()
    trainer = make_trainer(
        tmp_path,
        max_num_steps=9,
        validate_every_n_data_epochs=1,
        checkpoint_every_n_data_epochs=1,
        callbacks=[recorder],
    )
    assert trainer.run() == 0
    assert recorder.calls[8:14] == [
        ("step_end", 8),
        ("metrics", 8, "valid"),
        ("validation_end", 8),
        ("checkpoint_saved", 8),
        ("step_end", 9),
        ("metrics", 9, "train"),
    ]
    assert recorder.calls[14:] == [
        ("metrics", 9, "valid"),
        ("validation_end", 9),
        ("checkpoint_saved", 9),
        ("train_end", 9),
    ]


class SignalAt(TrainerCallback):
    def __init__(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def on_step_end(self, *, step_nr: int) -> None:
        if step_nr == self._step_nr:
            os.kill(os.getpid(), signal.SIGTERM)


def test_preemption_skips_train_end_and_a_resume_begins_at_the_saved_step(tmp_path: Path) -> None:
    first = CallRecorder()
    kwargs: dict[str, Any] = {"max_num_steps": 6, "validate_every_n_steps": 3}
    trainer = make_trainer(tmp_path, callbacks=[first, SignalAt(1)], **kwargs)
    assert trainer.run() == PREEMPTED_EXIT_CODE
    # The signal arrives during step 1; step 2 is where every rank agrees to stop.
    assert first.calls == [
        ("train_begin", 0),
        ("step_end", 1),
        ("step_end", 2),
        ("checkpoint_saved", 2),
    ]

    second = CallRecorder()
    assert make_trainer(tmp_path, callbacks=[second], **kwargs).run() == 0
    assert second.calls[0] == ("train_begin", 2)
    assert second.calls[-1] == ("train_end", 6)

    third = CallRecorder()
    assert make_trainer(tmp_path, callbacks=[third], **kwargs).run() == 0
    assert third.calls == []


class StepCounter(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, *, step_nr: int) -> None:
        self.steps.append(step_nr)


class OnlyTrainEnd(TrainerCallback):
    def on_train_end(self, *, step_nr: int) -> None:
        pass


def test_a_step_end_reaches_every_callback_that_overrides_it() -> None:
    first, second = StepCounter(), StepCounter()
    callbacks = CallbackList([first, OnlyTrainEnd(), second])
    callbacks.on_step_end(step_nr=3)
    callbacks.on_step_end(step_nr=4)
    assert first.steps == second.steps == [3, 4]
