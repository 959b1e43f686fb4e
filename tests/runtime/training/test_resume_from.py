"""``resume_from``: a fresh output directory continues from the full state of another run's
checkpoint, and ends bit-identical to the run that wrote it; bad paths are clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointDirectoryError, CheckpointManager
from gangs import FakeGang, Gangs
from runtime import PatienceEarlyStopper, Trainer
from tests.conftest import RunTorch, assert_ok, main_in_process, make_toy_trainer
from tests.workers import valid_toy
from tests.workers.train_toy import ToyBatch, ToyModel
from tests.workers.valid_toy import ToyEvalUnit, ValidToyConfig, make_valid_reader


def make_trainer(output_dir: Path, *, model_seed: int = 0, **kwargs: Any) -> Trainer[ToyBatch]:
    """Momentum SGD over more than one data epoch, validated and early-stopped by patience."""
    torch.manual_seed(model_seed)
    model = ToyModel()
    kwargs.setdefault("max_num_steps", 12)
    return make_toy_trainer(
        output_dir,
        model=model,
        momentum=0.9,
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", Gangs.single()),
        checkpoint_every_n_steps=4,
        valid_units=[ToyEvalUnit(model)],
        valid_data_readers=[make_valid_reader(FakeGang())],
        validate_every_n_steps=4,
        score_metric_name="mse",
        lower_better=True,
        early_stopper=PatienceEarlyStopper(patience=10),
        **kwargs,
    )


def trainer_state(output_dir: Path, step_nr: int) -> dict[str, Any]:
    path = output_dir / "checkpoints" / f"step_{step_nr}" / "trainer" / "rank_0.pt"
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def test_a_run_resumed_from_another_runs_checkpoint_ends_bit_identical(tmp_path: Path) -> None:
    make_trainer(tmp_path / "a").run()
    # Built with other weights: only the checkpoint's full state can make the runs agree.
    resumed = make_trainer(
        tmp_path / "b", model_seed=1, resume_from=tmp_path / "a" / "checkpoints" / "step_4"
    )
    resumed.run()

    assert resumed.step_nr == 12
    # The new directory holds only what the resumed run saved.
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == [
        "step_12",
        "step_8",
    ]
    original = CheckpointManager(tmp_path / "a" / "checkpoints", Gangs.single())
    copy = CheckpointManager(tmp_path / "b" / "checkpoints", Gangs.single())
    for step_nr in (8, 12):
        a_model, b_model = original.read_model_state(step_nr), copy.read_model_state(step_nr)
        assert a_model.keys() == b_model.keys()
        for name in a_model:
            assert torch.equal(a_model[name], b_model[name]), (step_nr, name)
        a_state, b_state = (
            trainer_state(tmp_path / "a", step_nr),
            trainer_state(tmp_path / "b", step_nr),
        )
        for section in ("train_state", "data_reader", "rng", "train_step", "validation"):
            assert repr(a_state[section]) == repr(b_state[section]), (step_nr, section)
    # The best score and the early stopper's count came along from step 4.
    assert b_state["validation"]["best_step_nr"] == a_state["validation"]["best_step_nr"]


def test_resume_from_is_refused_where_the_run_has_checkpoints_of_its_own(tmp_path: Path) -> None:
    make_trainer(tmp_path / "a", max_num_steps=4).run()
    make_trainer(tmp_path / "b", max_num_steps=4).run()
    source = tmp_path / "a" / "checkpoints" / "step_4"
    trainer = make_trainer(tmp_path / "b", resume_from=source)
    with pytest.raises(CheckpointDirectoryError) as info:
        trainer.run()
    message = str(info.value)
    assert str(tmp_path / "b" / "checkpoints") in message and str(source) in message
    assert "pass a new OUTPUT_DIR" in message and "drop resume_from" in message


def _incomplete(source: Path) -> Path:
    (source / "manifest.json").unlink()
    return source


def _model_only(source: Path) -> Path:
    manifest = json.loads((source / "manifest.json").read_text())
    (source / "manifest.json").write_text(json.dumps({**manifest, "kind": "model"}))
    return source


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda source: source.parent / "step_99", "does not exist"),
        (lambda source: source.parent, "is not a step_N checkpoint directory"),
        (lambda source: source / "model", "is not a step_N checkpoint directory"),
        (_incomplete, "has no manifest.json"),
        (_model_only, "holds only the model"),
    ],
    ids=["missing", "checkpoints_dir", "subdir", "incomplete", "model_only"],
)
def test_a_bad_resume_from_is_a_clear_error(tmp_path: Path, make_path: Any, message: str) -> None:
    make_trainer(tmp_path / "a", max_num_steps=4).run()
    path = make_path(tmp_path / "a" / "checkpoints" / "step_4")
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path / "b", resume_from=path)


def test_a_damaged_resume_from_fails_and_does_not_start_fresh(tmp_path: Path) -> None:
    make_trainer(tmp_path / "a", max_num_steps=4).run()
    source = tmp_path / "a" / "checkpoints" / "step_4"
    shutil.rmtree(source / "optimizer")
    trainer = make_trainer(tmp_path / "b", resume_from=source)
    with pytest.raises(Exception, match="step 4"):
        trainer.run()
    assert trainer.step_nr == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_from_on_the_command_line_under_torchrun(
    tmp_path: Path, run_torchrun: RunTorch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    recipe = ["-m", "tests.workers.valid_toy"]
    config = ["--config", "max_num_steps=12", "checkpoint_every_n_steps=4"]
    assert_ok(run_torchrun(2, *recipe, str(first), *config))
    source = first / "checkpoints" / "step_4"
    assert_ok(run_torchrun(2, *recipe, str(second), *config, "--resume-from", str(source)))

    for rank in (0, 1):
        log = (second / "logs" / f"rank_{rank}.log").read_text()
        assert "Resumed from the checkpoint of step 4." in log
    assert sorted(p.name for p in (second / "checkpoints").iterdir()) == ["step_12", "step_8"]
    original = CheckpointManager(first / "checkpoints", Gangs.single()).read_model_state(12)
    resumed = CheckpointManager(second / "checkpoints", Gangs.single()).read_model_state(12)
    assert original.keys() == resumed.keys()
    for name in original:
        assert torch.equal(original[name], resumed[name]), name

    # The second run has checkpoints of its own now: --resume-from again is a launch mistake.
    again = main_in_process(
        valid_toy.recipe, ValidToyConfig, [str(second), *config, "--resume-from", str(source)]
    )
    assert again.returncode == 2, again.stderr
    lines = again.stderr.strip().splitlines()
    assert lines[-1].startswith("error: The run's checkpoint directory"), again.stderr
    assert str(second / "checkpoints") in lines[-1] and str(source) in lines[-1]
    assert "pass a new OUTPUT_DIR" in lines[-1]


def test_a_bad_resume_from_on_the_command_line_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "step_3"
    result = main_in_process(
        valid_toy.recipe, ValidToyConfig, [str(tmp_path / "out"), "--resume-from", str(missing)]
    )
    assert result.returncode == 2, result.stderr
    assert f"error: resume_from is {missing}, which does not exist." in result.stderr
