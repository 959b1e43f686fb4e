"""The Trainer with the user's own parts: a metric recorder, a checkpoint manager of another
storage (in memory), and every part closed on every way out of ``run()``."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from checkpoint import (
    AbstractCheckpointManager,
    CheckpointInfo,
    CheckpointNotFoundError,
    LoadedCheckpoint,
    RetentionPolicy,
    plan_retention,
)
from runtime import PREEMPTED_EXIT_CODE, MapDataReader, TrainerCallback
from tests.conftest import ListRecorder, make_toy_trainer
from tests.runtime.training.test_callbacks import SignalAt
from tests.runtime.training.test_validation import make_trainer
from tests.workers.train_toy import ToyModel


class MemoryCheckpointManager(AbstractCheckpointManager):
    """Keeps checkpoints as copied state dicts in a dict: one process, no files."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, Any]] = {}
        self.unhealthy: dict[int, str] = {}
        self.num_closes = 0
        self.loaded_into: tuple[Module, Optimizer] | None = None

    @override
    def save_checkpoint(
        self,
        step_nr: int,
        *,
        model: Module,
        optimizer: Optimizer,
        trainer_state: Mapping[str, Any],
        score: float | None = None,
        async_checkpoint: bool = False,
        exclude: Sequence[str] = (),
    ) -> None:
        self.unhealthy.pop(step_nr, None)  # a rolled-back run saves the step again
        self.saved[step_nr] = copy.deepcopy(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "trainer": dict(trainer_state),
                "score": score,
            }
        )

    @override
    def load_last_checkpoint(
        self, *, model: Module, optimizer: Optimizer, reshard: bool = False
    ) -> LoadedCheckpoint | None:
        full = [
            step
            for step, saved in self.saved.items()
            if "optimizer" in saved and step not in self.unhealthy
        ]
        if not full:
            return None
        self.loaded_into = (model, optimizer)
        saved = copy.deepcopy(self.saved[max(full)])
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        return LoadedCheckpoint(step_nr=max(full), trainer_state=saved["trainer"], manifest={})

    @override
    def load_model(self, step_nr: int, *, model: Module) -> None:
        model.load_state_dict(copy.deepcopy(self.saved[step_nr]["model"]))

    @override
    def list_checkpoints(self) -> list[CheckpointInfo]:
        return [
            CheckpointInfo(
                step_nr=step,
                score=saved["score"],
                kind="full" if "optimizer" in saved else "model",
                size_bytes=0,
                healthy=step not in self.unhealthy,
            )
            for step, saved in sorted(self.saved.items())
        ]

    @override
    def mark_unhealthy(self, step_nrs: Sequence[int], *, reason: str) -> None:
        missing = set(step_nrs) - set(self.saved)
        if missing:
            raise CheckpointNotFoundError(f"No checkpoints of steps {sorted(missing)}.")
        for step_nr in step_nrs:
            self.unhealthy.setdefault(step_nr, reason)

    @override
    def apply_retention(self, policy: RetentionPolicy, *, lower_better: bool = True) -> None:
        plan = plan_retention(self.list_checkpoints(), policy, lower_better=lower_better)
        for step_nr in plan.delete:
            del self.saved[step_nr]
        for step_nr in plan.prune_to_model:
            self.saved[step_nr] = {"model": self.saved[step_nr]["model"], "score": None}

    @override
    def close(self) -> None:
        self.num_closes += 1


class StateAtStart(TrainerCallback):
    """The state of the model and optimizer that ``manager`` loaded into, as training begins."""

    def __init__(self, manager: MemoryCheckpointManager) -> None:
        self._manager = manager
        self.step_nr: int | None = None
        self.model: dict[str, Tensor] = {}
        self.optimizer: dict[str, Any] = {}

    def on_train_begin(self, *, step_nr: int) -> None:
        assert self._manager.loaded_into is not None
        model, optimizer = self._manager.loaded_into
        self.step_nr = step_nr
        self.model = copy.deepcopy(model.state_dict())
        self.optimizer = copy.deepcopy(optimizer.state_dict())


def assert_same_state(actual: Any, expected: Any) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_a_user_recorder_gets_train_and_valid_metrics_at_their_steps_and_is_closed(
    tmp_path: Any,
) -> None:
    recorder = ListRecorder()
    trainer = make_trainer(
        tmp_path,
        max_num_steps=6,
        publish_metrics_every_n_steps=2,
        validate_every_n_steps=3,
        recorders=[recorder],
    )
    assert trainer.run() == 0

    steps = [(run, step) for run, _, step in recorder.records]
    assert steps == [("train", 2), ("valid", 3), ("train", 4), ("train", 6), ("valid", 6)]
    train_values = [values for run, values, _ in recorder.records if run == "train"]
    assert all({"loss", "grad_norm", "lr", "num_targets"} <= set(v) for v in train_values)
    valid_values = [values for run, values, _ in recorder.records if run == "valid"]
    assert all({"mse", "num_targets"} <= set(v) for v in valid_values)
    assert recorder.num_closes == 1


class FailAt(TrainerCallback):
    def __init__(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        if step_nr == self._step_nr:
            raise RuntimeError(f"failed at step {step_nr}")


@pytest.mark.parametrize("ending", ["exception", "preemption"])
def test_every_part_is_closed_when_the_run_ends_early(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    reader_closes: list[MapDataReader[Any]] = []
    original_close = MapDataReader.close

    def counting_close(reader: MapDataReader[Any]) -> None:
        reader_closes.append(reader)
        original_close(reader)

    monkeypatch.setattr(MapDataReader, "close", counting_close)
    recorder, manager = ListRecorder(), MemoryCheckpointManager()
    callback = FailAt(2) if ending == "exception" else SignalAt(1)
    trainer = make_toy_trainer(
        tmp_path,
        max_num_steps=6,
        recorders=[recorder],
        checkpoint_manager=manager,
        callbacks=[callback],
    )
    if ending == "exception":
        with pytest.raises(RuntimeError, match="failed at step 2"):
            trainer.run()
    else:
        assert trainer.run() == PREEMPTED_EXIT_CODE
        assert list(manager.saved) == [2]
    assert recorder.num_closes == 1
    assert manager.num_closes == 1
    assert len(reader_closes) == 1
    trainer.close()  # a second close does nothing
    assert (recorder.num_closes, manager.num_closes, len(reader_closes)) == (1, 1, 1)


def toy_model() -> Module:
    torch.manual_seed(0)
    return ToyModel()


def test_training_resumes_through_a_checkpoint_manager_of_another_storage(
    tmp_path: Any,
) -> None:
    manager = MemoryCheckpointManager()
    kwargs: dict[str, Any] = {
        "momentum": 0.9,
        "checkpoint_manager": manager,
        "checkpoint_every_n_steps": 2,
        "keep_last_n_checkpoints": 1,
    }
    first_model = toy_model()
    assert make_toy_trainer(tmp_path, model=first_model, max_num_steps=3, **kwargs).run() == 0
    assert list(manager.saved) == [3]  # step 2, then 3 at the end; keep-last kept one
    assert manager.loaded_into is None  # nothing to resume from
    saved_optimizer = copy.deepcopy(manager.saved[3]["optimizer"])
    assert saved_optimizer["state"], "momentum buffers make the optimizer state worth comparing"

    at_start = StateAtStart(manager)
    second_model = ToyModel()  # other weights: the resume must replace them
    second = make_toy_trainer(
        tmp_path, model=second_model, max_num_steps=5, callbacks=[at_start], **kwargs
    )
    assert second.run() == 0
    assert at_start.step_nr == 3
    assert_same_state(at_start.model, first_model.state_dict())
    assert_same_state(at_start.optimizer, saved_optimizer)
    assert list(manager.saved) == [5]

    # Resumed through memory, the run ends where an uninterrupted one does.
    whole_model = toy_model()
    assert make_toy_trainer(tmp_path, model=whole_model, max_num_steps=5, momentum=0.9).run() == 0
    assert_same_state(second_model.state_dict(), whole_model.state_dict())


def test_a_storage_of_its_own_passes_unhealthy_checkpoints_over(tmp_path: Any) -> None:
    manager = MemoryCheckpointManager()
    kwargs: dict[str, Any] = {"checkpoint_manager": manager, "checkpoint_every_n_steps": 2}
    assert make_toy_trainer(tmp_path, max_num_steps=4, **kwargs).run() == 0
    manager.mark_unhealthy([4], reason="a loss spike")
    assert not manager.is_healthy(4) and manager.last_healthy_step() == 2

    at_start = StateAtStart(manager)
    assert make_toy_trainer(tmp_path, max_num_steps=5, callbacks=[at_start], **kwargs).run() == 0
    assert at_start.step_nr == 2
    assert manager.is_healthy(4) and manager.last_healthy_step(before=5) == 4
