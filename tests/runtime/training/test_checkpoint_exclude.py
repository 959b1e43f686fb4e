"""``checkpoint_exclude``: model entries left out of checkpoints keep, on resume, what the
model was built with; the manifest lists them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint import CheckpointManager
from gangs import Gangs
from runtime import Trainer, TrainerCallback
from tests.conftest import make_toy_trainer, read_jsonl
from tests.workers.train_toy import ToyBatch, ToyModel
from tests.workers.valid_toy import ToyEvalUnit, make_valid_reader

EXCLUDE = ["up.*", "norm.bias"]


def make_trainer(
    tmp_path: Path, *, up_value: float | None = None, **kwargs: Any
) -> Trainer[ToyBatch]:
    """A toy run whose ``up`` layer is a frozen table, filled with ``up_value`` if given."""
    torch.manual_seed(0)
    model = ToyModel()
    model.up.requires_grad_(False)
    if up_value is not None:
        with torch.no_grad():
            model.up.weight.fill_(up_value)
    kwargs.setdefault("checkpoint_exclude", EXCLUDE)
    return make_toy_trainer(tmp_path, model=model, checkpoint_every_n_steps=2, **kwargs)


class Snapshot(TrainerCallback):
    """The model's values when training begins: what the resume left in it."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.state: dict[str, torch.Tensor] = {}

    def on_train_begin(self, *, step_nr: int) -> None:
        self.state = {k: v.detach().clone() for k, v in self._model.state_dict().items()}


def test_excluded_entries_are_not_on_disk_and_the_manifest_lists_them(tmp_path: Path) -> None:
    make_trainer(tmp_path, max_num_steps=2).run()
    step_dir = tmp_path / "checkpoints" / "step_2"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["excluded"] == ["norm.bias", "up.bias", "up.weight"]
    saved = CheckpointManager(tmp_path / "checkpoints", Gangs.single()).read_model_state(2)
    assert sorted(saved) == ["down.bias", "down.weight", "norm.weight"]


def test_a_resume_keeps_what_the_model_was_built_with(tmp_path: Path) -> None:
    make_trainer(tmp_path, max_num_steps=2).run()
    saved = CheckpointManager(tmp_path / "checkpoints", Gangs.single()).read_model_state(2)

    resumed = make_trainer(tmp_path, max_num_steps=4, up_value=0.5)
    snapshot = Snapshot(resumed._unit.model)
    resumed.add_callback(snapshot)
    resumed.run()
    assert resumed.step_nr == 4
    # The table keeps the values it was built with; the rest comes from the checkpoint.
    assert torch.equal(snapshot.state["up.weight"], torch.full((16, 8), 0.5))
    for name in ("down.weight", "down.bias", "norm.weight"):
        assert torch.equal(snapshot.state[name], saved[name]), name
    built = make_trainer(tmp_path / "unused", max_num_steps=1)._unit.model.state_dict()
    assert torch.equal(snapshot.state["norm.bias"], built["norm.bias"])
    assert torch.equal(snapshot.state["up.bias"], built["up.bias"])


def test_evaluating_a_checkpoint_keeps_the_excluded_entries(tmp_path: Path) -> None:
    make_trainer(tmp_path, max_num_steps=2).run()
    torch.manual_seed(1)
    model = ToyModel()
    before = model.up.weight.detach().clone()
    CheckpointManager(tmp_path / "checkpoints", Gangs.single()).load_model(2, model=model)
    assert torch.equal(model.up.weight, before)


def test_a_pattern_that_matches_nothing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=re.escape("The checkpoint_exclude pattern 'embed.*' matches no")
    ):
        make_trainer(tmp_path, checkpoint_exclude=["embed.*"])


def test_with_init_from_a_resume_and_an_evaluation_take_the_excluded_entries_from_it(
    tmp_path: Path,
) -> None:
    """The frozen base of a LoRA run: left out of checkpoints, loaded again from init_from."""
    torch.manual_seed(5)
    base = tmp_path / "base.pt"
    torch.save(ToyModel().state_dict(), base)
    initial = torch.load(base, weights_only=True)

    def with_validation(**kwargs: Any) -> Trainer[ToyBatch]:
        torch.manual_seed(0)
        model = ToyModel()
        model.up.requires_grad_(False)
        with torch.no_grad():
            model.up.weight.fill_(0.5)
        return make_toy_trainer(
            tmp_path,
            model=model,
            init_from=base,
            checkpoint_exclude=["up.*"],
            checkpoint_every_n_steps=2,
            valid_units=[ToyEvalUnit(model)],
            valid_data_readers=[make_valid_reader(Gangs.single().dp)],
            validate_every_n_steps=2,
            metrics_dir=tmp_path / "metrics",
            **kwargs,
        )

    with_validation(max_num_steps=2).run()
    saved = CheckpointManager(tmp_path / "checkpoints", Gangs.single()).read_model_state(2)
    resumed = with_validation(max_num_steps=4)
    resumed.add_callback(snapshot := Snapshot(resumed._unit.model))
    resumed.run()
    assert resumed.step_nr == 4
    for name in ("up.weight", "up.bias"):
        assert torch.equal(snapshot.state[name], initial[name]), name
    for name in ("down.weight", "down.bias", "norm.weight", "norm.bias"):
        assert torch.equal(snapshot.state[name], saved[name]), name

    valid = read_jsonl(tmp_path / "metrics" / "valid.jsonl")[-1]
    results = with_validation(max_num_steps=4).evaluate_checkpoint("last")
    assert results["eval"]["mse"] == pytest.approx(valid["mse"])
