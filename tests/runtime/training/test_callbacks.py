"""Trainer callbacks: the documented order and arguments, recorded in one process."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

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

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
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


class EveryHookRecorder(CallRecorder):
    """Also records the per-step and data-epoch moments."""

    def on_epoch_begin(self, *, epoch_nr: int, step_nr: int) -> None:
        self.calls.append(("epoch_begin", step_nr, epoch_nr))

    def on_step_begin(self, *, step_nr: int, batches: Sequence[Any]) -> None:
        self.calls.append(("step_begin", step_nr, len(batches)))

    def on_before_optimizer_step(self, *, step_nr: int, model: nn.Module) -> None:
        grads = [p.grad for p in model.parameters()]
        self.calls.append(("before_optimizer_step", step_nr, all(g is not None for g in grads)))

    def on_step_end(self, *, step_nr: int, metrics: Mapping[str, Any] | None = None) -> None:
        self.calls.append(("step_end", step_nr, None if metrics is None else metrics["loss"]))

    def on_out_of_data(self, *, step_nr: int, epoch_nr: int) -> None:
        self.calls.append(("out_of_data", step_nr, epoch_nr))

    def on_epoch_end(self, *, epoch_nr: int, step_nr: int) -> None:
        self.calls.append(("epoch_end", step_nr, epoch_nr))


def test_callbacks_fire_in_the_documented_order(tmp_path: Path) -> None:
    recorder = EveryHookRecorder()
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
    loss = {step_nr: recorder.values["train", step_nr]["loss"] for step_nr in (2, 4)}
    assert recorder.calls == [
        ("train_begin", 0),
        ("epoch_begin", 0, 1),
        ("metrics", 0, "valid"),
        ("validation_end", 0),
        ("step_begin", 1, 1),
        ("before_optimizer_step", 1, True),
        ("step_end", 1, None),
        ("step_begin", 2, 1),
        ("before_optimizer_step", 2, True),
        ("metrics", 2, "train"),
        ("step_end", 2, loss[2]),
        ("metrics", 2, "valid"),
        ("validation_end", 2),
        ("step_begin", 3, 1),
        ("before_optimizer_step", 3, True),
        ("step_end", 3, None),
        ("step_begin", 4, 1),
        ("before_optimizer_step", 4, True),
        ("metrics", 4, "train"),
        ("step_end", 4, loss[4]),
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

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
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

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        self.steps.append(step_nr)


class OnlyTrainEnd(TrainerCallback):
    def on_train_end(self, *, step_nr: int) -> None:
        pass


def test_a_step_end_reaches_every_callback_that_overrides_it() -> None:
    first, second = StepCounter(), StepCounter()
    callbacks = CallbackList([first, OnlyTrainEnd(), second])
    callbacks.on_step_end(step_nr=3, metrics=None)
    callbacks.on_step_end(step_nr=4, metrics=None)
    assert first.steps == second.steps == [3, 4]


def test_data_epochs_fire_out_of_data_and_epoch_hooks(tmp_path: Path) -> None:
    # 32 examples in batches of 4: epochs of 8 steps; validated and saved after each epoch.
    recorder = EveryHookRecorder()
    trainer = make_trainer(
        tmp_path,
        max_num_steps=None,
        max_num_data_epochs=2,
        validate_every_n_data_epochs=1,
        checkpoint_every_n_data_epochs=1,
        callbacks=[recorder],
    )
    assert trainer.run() == 0
    epoch_calls = [
        call
        for call in recorder.calls
        if call[0] not in ("step_begin", "before_optimizer_step", "step_end", "metrics")
    ]
    assert epoch_calls == [
        ("train_begin", 0),
        ("epoch_begin", 0, 1),
        ("out_of_data", 8, 1),
        ("validation_end", 8),
        ("checkpoint_saved", 8),
        ("epoch_end", 8, 1),
        ("epoch_begin", 8, 2),
        ("out_of_data", 16, 2),
        ("epoch_end", 16, 2),
        ("validation_end", 16),
        ("checkpoint_saved", 16),
        ("train_end", 16),
    ]


class ClipToZero(TrainerCallback):
    """A custom clipping: zeroes the gradient of the bias, so the bias never moves."""

    def __init__(self) -> None:
        self.grad_norms: list[float] = []

    def on_before_optimizer_step(self, *, step_nr: int, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            assert param.grad is not None
            self.grad_norms.append(float(param.grad.norm()))
            if name.endswith("bias"):
                param.grad.zero_()


def test_the_gradient_hook_sees_final_gradients_and_changes_the_update(tmp_path: Path) -> None:
    clip = ClipToZero()
    trainer = make_trainer(
        tmp_path / "a", max_num_steps=3, max_gradient_norm=1e-3, validate_every_n_steps=3
    )
    trainer.add_callback(clip)
    before = {n: p.detach().clone() for n, p in trainer._unit.model.named_parameters()}
    trainer.run()
    after = dict(trainer._unit.model.named_parameters())
    biases = [name for name in before if name.endswith("bias")]
    assert biases
    for name, value in before.items():
        moved = not torch.equal(value, after[name].detach())
        assert moved == (name not in biases), name
    # The Trainer's clipping came first: the hook saw the clipped gradients.
    assert max(clip.grad_norms) <= 1e-3 * 1.0001


class Counter(TrainerCallback):
    """A callback with a state: how many steps it saw, across launches."""

    def __init__(self) -> None:
        self.num_steps = 0

    def on_step_end(self, *, step_nr: int, metrics: Mapping[str, Any] | None = None) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.num_steps = state["num_steps"]


class Extra:
    """A registered object that is no callback (RecIS's extra fields)."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.fields)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.fields = dict(state)


def test_stateful_callbacks_and_registered_objects_survive_a_resume(tmp_path: Path) -> None:
    counter, extra = Counter(), Extra()
    extra.fields["table_version"] = 7
    first = make_trainer(
        tmp_path, max_num_steps=4, checkpoint_every_n_steps=2, validate_every_n_steps=2
    )
    first.add_callback(counter)
    first.register_stateful("extra", extra)
    first.run()
    assert counter.num_steps == 4

    state = torch.load(
        tmp_path / "checkpoints" / "step_4" / "trainer" / "rank_0.pt", weights_only=True
    )
    assert state["stateful"] == {
        "callbacks.Counter": {"num_steps": 4},
        "extra": {"table_version": 7},
    }

    counter, extra = Counter(), Extra()
    second = make_trainer(
        tmp_path, max_num_steps=6, checkpoint_every_n_steps=2, validate_every_n_steps=2
    )
    second.add_callback(counter)
    second.register_stateful("extra", extra)
    second.run()
    assert counter.num_steps == 6
    assert extra.fields == {"table_version": 7}


def test_register_stateful_rejects_objects_without_state_and_taken_names(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, validate_every_n_steps=2)
    with pytest.raises(TypeError, match="must have state_dict\\(\\) and load_state_dict\\(\\)"):
        trainer.register_stateful("x", object())  # type: ignore[arg-type]
    trainer.register_stateful("x", Extra())
    with pytest.raises(ValueError, match="The name 'x' is taken"):
        trainer.register_stateful("x", Extra())
