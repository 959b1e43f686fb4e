"""Evaluation outside the step loop: evaluate_units, the Evaluator, saved checkpoints, --evaluate."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint import CheckpointManager, CheckpointNotFoundError
from gangs import Gangs
from runtime import Evaluator, combine_scores, evaluate_units, main
from tests.conftest import ListRecorder, RunTorch, assert_ok, read_jsonl
from tests.runtime.training.test_validation import make_trainer, scripted
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel
from tests.workers.valid_toy import ToyEvalUnit, ValidToyConfig, make_valid_reader, recipe


def expected_mse(model: nn.Module, size: int) -> float:
    dataset = ToyDataset(size)
    with torch.no_grad():
        errors = (model(dataset.x) - dataset.y).pow(2) * dataset.mask
    return (errors.sum() / dataset.mask.sum()).item()


# ------------------------------------------------------------------------ evaluate_units


@pytest.mark.parametrize("training", [True, False], ids=["from_train", "from_eval"])
def test_evaluate_units_publishes_each_unit_and_restores_the_mode(training: bool) -> None:
    torch.manual_seed(0)
    model = ToyModel().train(training)
    gangs = Gangs.single()
    recorder = ListRecorder()
    units = [ToyEvalUnit(model), ToyEvalUnit(model, display_name="small")]
    readers = [make_valid_reader(gangs.dp, size=10), make_valid_reader(gangs.dp, size=3)]

    for step_nr in (5, 7):
        results = evaluate_units(
            model=model,
            units=units,
            data_readers=readers,
            gangs=gangs,
            step_nr=step_nr,
            recorder=recorder,
        )
        assert model.training is training
        assert list(results) == ["valid", "valid/small"]

    # The readers were reset and the metrics too: the second evaluation repeats the first.
    assert [(run, step) for run, _, step in recorder.records] == [
        ("valid", 5),
        ("valid/small", 5),
        ("valid", 7),
        ("valid/small", 7),
    ]
    for index, size in ((0, 10), (1, 3)):
        first, second = recorder.records[index][1], recorder.records[index + 2][1]
        assert first == second
        assert first["num_targets"] == int(ToyDataset(size).mask.sum())
        assert first["mse"] == pytest.approx(expected_mse(model, size))
    assert not recorder.closed


class FailingEvalUnit(ToyEvalUnit):
    def __call__(self, batch: ToyBatch) -> None:
        raise RuntimeError("broken eval unit")


def test_a_failing_unit_leaves_the_model_in_its_mode() -> None:
    model = ToyModel().train()
    gangs = Gangs.single()
    with pytest.raises(RuntimeError, match="broken eval unit"):
        evaluate_units(
            model=model,
            units=[FailingEvalUnit(model)],
            data_readers=[make_valid_reader(gangs.dp)],
            gangs=gangs,
            step_nr=1,
            recorder=ListRecorder(),
        )
    assert model.training


def test_combine_scores_is_the_mean_over_units() -> None:
    results = {"valid/a": {"nll_loss": 1.0, "x": 9.0}, "valid/b": {"nll_loss": 4.0}}
    assert combine_scores(results, "nll_loss") == 2.5
    assert combine_scores({"valid": {"acc": 0.25}}, "acc") == 0.25
    with pytest.raises(
        ValueError,
        match=r"score_metric_name is 'x', but the unit of run 'valid/b' records only "
        r"\['nll_loss'\]\. Pick one of those or record it\.",
    ):
        combine_scores(results, "x")


# ----------------------------------------------------------------------------- Evaluator


def test_evaluator_publishes_as_eval() -> None:
    torch.manual_seed(0)
    model = ToyModel()
    gangs = Gangs.single()
    recorder = ListRecorder()
    evaluator = Evaluator(
        model=model,
        units=[ToyEvalUnit(model), ToyEvalUnit(model, display_name="tiny")],
        data_readers=[make_valid_reader(gangs.dp, size=10), make_valid_reader(gangs.dp, size=2)],
        gangs=gangs,
        recorder=recorder,
    )
    results = evaluator.run(step_nr=3)
    assert [(run, step) for run, _, step in recorder.records] == [("eval", 3), ("eval/tiny", 3)]
    assert results["eval"]["mse"] == pytest.approx(expected_mse(model, 10))
    assert results["eval/tiny"]["mse"] == pytest.approx(expected_mse(model, 2))
    assert model.training


@pytest.mark.parametrize(
    ("num_units", "num_readers", "message"),
    [
        (0, 0, "units must hold at least one EvalUnit."),
        (2, 1, "units and data_readers must have the same length, but have 2 and 1 elements"),
    ],
)
def test_evaluator_rejects_bad_arguments(num_units: int, num_readers: int, message: str) -> None:
    model = ToyModel()
    gangs = Gangs.single()
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        Evaluator(
            model=model,
            units=[ToyEvalUnit(model) for _ in range(num_units)],
            data_readers=[make_valid_reader(gangs.dp) for _ in range(num_readers)],
            gangs=gangs,
            recorder=ListRecorder(),
        )


# ---------------------------------------------------------- Trainer.evaluate_checkpoint


def train_with_checkpoints(tmp_path: Path) -> dict[int, dict[str, Any]]:
    """Trains 6 steps, validated and checkpointed every 2; returns valid.jsonl by step."""
    trainer = make_trainer(
        tmp_path,
        validate_every_n_steps=2,
        checkpoint_every_n_steps=2,
        score_metric_name="mse",
        lower_better=True,
    )
    assert trainer.run() == 0
    records = read_jsonl(tmp_path / "metrics" / "valid.jsonl")
    return {r.pop("step_nr"): r for r in records}


def fresh_trainer(tmp_path: Path, **kwargs: Any) -> Any:
    torch.manual_seed(123)  # different weights than the trained model's start
    kwargs.setdefault("score_metric_name", "mse")
    kwargs.setdefault("lower_better", True)
    return make_trainer(tmp_path, model=ToyModel(), validate_every_n_steps=2, **kwargs)


def test_evaluating_a_checkpoint_reproduces_its_validation(tmp_path: Path) -> None:
    valid = train_with_checkpoints(tmp_path)
    best_step = min(valid, key=lambda step: valid[step]["mse"])

    for which, step_nr in ((4, 4), ("last", 6), ("best", best_step)):
        results = fresh_trainer(tmp_path).evaluate_checkpoint(which)
        assert list(results) == ["eval"]
        assert results["eval"] == pytest.approx(valid[step_nr]), which

    records = read_jsonl(tmp_path / "metrics" / "eval.jsonl")
    assert [r.pop("step_nr") for r in records] == [4, 6, best_step]
    assert records[0] == pytest.approx(valid[4])
    # The validation values were not touched.
    assert sorted(valid) == [2, 4, 6]
    assert len(read_jsonl(tmp_path / "metrics" / "valid.jsonl")) == 3


def test_a_standalone_evaluator_evaluates_a_saved_checkpoint(tmp_path: Path) -> None:
    valid = train_with_checkpoints(tmp_path)
    torch.manual_seed(123)
    model = ToyModel()
    gangs = Gangs.single()
    recorder = ListRecorder()
    evaluator = Evaluator(
        model=model,
        units=[ToyEvalUnit(model)],
        data_readers=[make_valid_reader(gangs.dp)],
        gangs=gangs,
        recorder=recorder,
    )
    manager = CheckpointManager(tmp_path / "checkpoints", gangs)
    results = evaluator.evaluate_checkpoint(manager, 2)
    assert results["eval"] == pytest.approx(valid[2])
    assert recorder.records[0][0::2] == ("eval", 2)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint of step 7"):
        evaluator.evaluate_checkpoint(manager, 7)


def test_best_follows_the_orientation(tmp_path: Path) -> None:
    scores = {2: 2.0, 4: 1.0, 6: 3.0}
    kwargs: dict[str, Any] = {
        "units": scripted(scores),
        "validate_every_n_steps": 2,
        "checkpoint_every_n_steps": 2,
        "score_metric_name": "score",
    }
    assert make_trainer(tmp_path, lower_better=True, **kwargs).run() == 0
    for lower_better, step_nr in ((True, 4), (False, 6)):
        results = make_trainer(tmp_path, lower_better=lower_better, **kwargs).evaluate_checkpoint(
            "best"
        )
        assert results["eval"]["score"] == scores[step_nr]


def test_evaluating_a_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="There are no committed checkpoints in"):
        fresh_trainer(tmp_path).evaluate_checkpoint("last")

    train_with_checkpoints(tmp_path)
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"There is no committed checkpoint of step 3 in .*; the steps there are 2, 4, 6\.",
    ):
        fresh_trainer(tmp_path).evaluate_checkpoint(3)
    with pytest.raises(ValueError, match="which must be 'last', 'best' or a step number"):
        fresh_trainer(tmp_path).evaluate_checkpoint("first")  # type: ignore[arg-type]


def test_best_needs_a_scored_checkpoint(tmp_path: Path) -> None:
    assert make_trainer(tmp_path, validate_every_n_steps=6, checkpoint_every_n_steps=3).run() == 0
    # Without score_metric_name the checkpoints are stored without a score.
    with pytest.raises(
        CheckpointNotFoundError, match="has a validation score, so none is the best"
    ):
        make_trainer(tmp_path, validate_every_n_steps=6).evaluate_checkpoint("best")


# ------------------------------------------------------------------ the command line


def train_recipe(output_dir: Path, *, valid_size: int = 11) -> dict[int, dict[str, Any]]:
    """Trains the toy recipe in this process; returns its valid.jsonl by step."""
    config = ValidToyConfig(max_num_steps=6, keep_best_n_checkpoints=1, valid_size=valid_size)
    assert recipe(config, output_dir).run() == 0
    (output_dir / "config.yaml").write_text("# the training's config\n")
    return {r.pop("step_nr"): r for r in read_jsonl(output_dir / "metrics" / "valid.jsonl")}


def checkpoint_dirs(output_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (output_dir / "checkpoints").iterdir())


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """``main()`` in this process: its exit status and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(recipe, ValidToyConfig, argv=argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("which", ["last", "7"])
def test_main_leaves_the_root_logger_as_it_found_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    # A handler left on the root logger would write to this test's closed stderr capture
    # and keep the log file open, and every later log line would be a logging error.
    train_recipe(tmp_path)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    code, _ = run_main([str(tmp_path), "--evaluate", which], capsys)
    assert code == (0 if which == "last" else 2)
    assert root.handlers == handlers
    assert root.level == level


def test_the_evaluate_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    valid = train_recipe(tmp_path)
    best_step = min(valid, key=lambda step: valid[step]["mse"])
    kept = checkpoint_dirs(tmp_path)
    assert kept == sorted({best_step, 6})

    code, stderr = run_main([str(tmp_path), "--evaluate", "best"], capsys)
    assert code == 0, stderr
    (record,) = read_jsonl(tmp_path / "metrics" / "eval.jsonl")
    assert record.pop("step_nr") == best_step
    assert record == pytest.approx(valid[best_step])
    assert f"eval step {best_step}: mse" in (tmp_path / "logs" / "rank_0.log").read_text()
    # No training happened, and the training's config.yaml is untouched.
    assert checkpoint_dirs(tmp_path) == kept
    assert len(read_jsonl(tmp_path / "metrics" / "valid.jsonl")) == len(valid)
    assert (tmp_path / "config.yaml").read_text() == "# the training's config\n"

    errors = {
        "newest": "error: argument --evaluate: expected 'last', 'best' or a step number, "
        "but got 'newest'.",
        "-1": "error: argument --evaluate: expected 'last', 'best' or a step number, but got '-1'",
        "2" if best_step != 2 else "4": "error: There is no committed checkpoint of step",
    }
    for which, message in errors.items():
        code, stderr = run_main([str(tmp_path), "--evaluate", which], capsys)
        assert code == 2, which
        assert message in stderr, stderr
    code, stderr = run_main([str(tmp_path / "empty"), "--evaluate", "last"], capsys)
    assert code == 2
    assert "error: There are no committed checkpoints in" in stderr


def test_the_evaluate_flag_under_torchrun(tmp_path: Path, run_torchrun: RunTorch) -> None:
    valid = train_recipe(tmp_path)
    # Saved by one process, evaluated by two: the valid data is sharded over both.
    result = run_torchrun(2, "-m", "tests.workers.valid_toy", str(tmp_path), "--evaluate", "6")
    assert_ok(result)
    (record,) = read_jsonl(tmp_path / "metrics" / "eval.jsonl")
    assert record.pop("step_nr") == 6
    assert record == pytest.approx(valid[6], rel=1e-5)
    for rank in (0, 1):
        log_text = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        assert "Evaluating the model of the checkpoint of step 6." in log_text
