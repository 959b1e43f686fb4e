"""Loss-spike rollback: a spike (or a NaN) on any rank rolls every rank back to the checkpoint
before it and skips its data, ending bit-identical to a run whose data never held it."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from gangs import Gangs
from runtime import PREEMPTED_EXIT_CODE, LossSpikeError, LossSpikeGuard, TrainerCallback
from tests.conftest import RunTorch, assert_ok, read_jsonl
from tests.workers.train_spike import full_params, make_trainer

WORKER = "tests/workers/train_spike.py"

# Batches of 4 unshuffled examples: example 25 is in step 7's batch (examples 24..27); steps
# 5..8 read examples 16..31.
GUARD = {"window": 8, "min_history": 3, "factor": 3.0, "margin": 1}


def train(tmp_path: Path, name: str, **options: Any) -> tuple[Any, dict[str, torch.Tensor], Any]:
    trainer, model, log = make_trainer(Gangs.single(), tmp_path / name, options)
    status = trainer.run()
    return status, full_params(model), log.rollbacks


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of a run whose data never held the batches of steps 5..8 (examples 16..31)."""
    _, weights, _ = train(tmp_path_factory.mktemp("clean"), "clean", drop=[16, 32], guard=GUARD)
    return weights


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "the weights differ"


@pytest.mark.parametrize("poison", [100.0, math.nan], ids=["finite", "nan"])
def test_a_spike_rolls_back_and_ends_as_a_run_without_its_data(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    poison: float,
    clean: dict[str, torch.Tensor],
) -> None:
    # Found at the publish of step 8 (before its checkpoint): back to step 4, skipping the data
    # of steps 5..7 and a margin of one step.
    with caplog.at_level(logging.WARNING, logger="runtime"):
        status, spiked, rollbacks = train(
            tmp_path, "spiked", poison_indices=[25], poison_factor=poison, guard=GUARD
        )
    assert status == 0
    assert rollbacks == [(7, 4)]
    (line,) = [r.getMessage() for r in caplog.records if "Loss spike" in r.getMessage()]
    assert line.startswith(f"Loss spike at step 7: loss {'nan' if math.isnan(poison) else '126.5'}")
    assert "against a running median 1.291; rolled back to step 4, skipping the data of steps " in (
        line
    )
    assert "5..8" in line
    records = read_jsonl(tmp_path / "spiked" / "metrics" / "train.jsonl")
    assert [r["num_rollbacks"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert_same_weights(spiked, clean)


def test_a_lookback_rolls_back_further_and_marks_the_checkpoints_between_unhealthy(
    tmp_path: Path, clean: dict[str, torch.Tensor]
) -> None:
    # The spike may have begun at step 5, so the checkpoint of step 6 is not trusted: back to
    # step 4, and step 6 saved anew (the unhealthy one moved aside).
    guard = GUARD | {"lookback": 2}
    status, spiked, rollbacks = train(
        tmp_path, "spiked", poison_indices=[25], guard=guard, checkpoint_every=2, publish_every=4
    )
    assert (status, rollbacks) == (0, [(7, 4)])
    checkpoints = tmp_path / "spiked" / "checkpoints"
    assert (checkpoints / "step_6.unhealthy").is_dir()
    assert_same_weights(spiked, clean)


def test_the_per_step_check_rolls_back_at_the_spike_step(
    tmp_path: Path, clean: dict[str, torch.Tensor]
) -> None:
    # No publish and no checkpoint between: only the per-step check finds the spike at step 7.
    guard = GUARD | {"check_every_step": True}
    status, spiked, rollbacks = train(
        tmp_path, "spiked", poison_indices=[25], guard=guard, publish_every=100
    )
    assert (status, rollbacks) == (0, [(7, 4)])
    assert_same_weights(spiked, clean)


class Weights(TrainerCallback):
    """The weights right after the rollback, and after each step that follows it."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_rollback(self, *, from_step: int, to_step: int) -> None:
        self.after[to_step] = self._snapshot()

    def on_step_end(self, *, step_nr: int, metrics: Any = None) -> None:
        if self.after:
            self.after[step_nr] = self._snapshot()

    def _snapshot(self) -> list[torch.Tensor]:
        assert self.model is not None
        return [p.detach().clone() for p in self.model.parameters()]


def test_lr_cooling_scales_the_steps_after_a_rollback(tmp_path: Path) -> None:
    # A factor so small that an update rounds away: the cooled steps 5 and 6 leave the weights
    # of step 4, step 7 moves them.
    guard = GUARD | {"cool_lr_steps": 2, "cool_lr_factor": 1e-30}
    weights = Weights()
    options = {"poison_indices": [25], "guard": guard}
    trainer, model, _ = make_trainer(Gangs.single(), tmp_path, options, (weights,))
    weights.model = model
    assert trainer.run() == 0
    same = [all(map(torch.equal, weights.after[4], weights.after[s])) for s in (5, 6, 7)]
    assert same == [True, True, False]


class Crash(TrainerCallback):
    """Stops the process the way kill -9 does for the checkpoints: nothing more is saved."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._rolled_back = False

    def on_rollback(self, *, from_step: int, to_step: int) -> None:
        self._rolled_back = True
        if self._where == "in the rollback":
            raise KeyboardInterrupt

    def on_step_end(self, *, step_nr: int, metrics: Any = None) -> None:
        if self._where == "after the rollback" and self._rolled_back and step_nr == 9:
            raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["in the rollback", "after the rollback"])
def test_a_run_killed_in_or_after_a_rollback_resumes_to_the_same_weights(
    tmp_path: Path, where: str, clean: dict[str, torch.Tensor]
) -> None:
    # Killed in the rollback, the run resumes from step 4 and meets the spike again; killed at
    # step 9 after it, from the checkpoint of step 8 that holds the rollback.
    options = {"poison_indices": [25], "guard": GUARD}
    trainer, _, _ = make_trainer(Gangs.single(), tmp_path / "killed", options, (Crash(where),))
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    status, resumed, rollbacks = train(tmp_path, "killed", **options)
    assert (status, rollbacks) == (0, [] if where == "after the rollback" else [(7, 4)])
    records = read_jsonl(tmp_path / "killed" / "metrics" / "train.jsonl")
    assert records[-1]["step_nr"] == 10 and records[-1]["num_rollbacks"] == 1
    # The uninterrupted run ends with the weights of the clean run (tested above).
    assert_same_weights(resumed, clean)


class Sigterm(TrainerCallback):
    def on_rollback(self, *, from_step: int, to_step: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_in_a_rollback_stops_after_it_and_resumes_to_the_same_weights(
    tmp_path: Path, clean: dict[str, torch.Tensor]
) -> None:
    # Every rank stops at the next step, 5, with a checkpoint that holds the rollback.
    options = {"poison_indices": [25], "guard": GUARD}
    trainer, _, _ = make_trainer(Gangs.single(), tmp_path, options, (Sigterm(),))
    assert trainer.run() == PREEMPTED_EXIT_CODE
    assert (tmp_path / "checkpoints" / "step_5").is_dir()
    trainer, model, log = make_trainer(Gangs.single(), tmp_path, options)
    assert trainer.run() == 0
    assert log.rollbacks == []
    assert_same_weights(full_params(model), clean)


def test_a_spike_before_the_first_checkpoint_stops_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(
        LossSpikeError,
        match=r"Loss spike at step 3 \(loss 143.7 against a running median of 1.137\) before the "
        r"first checkpoint, so there is nothing to roll back to",
    ):
        train(tmp_path, "run", poison_indices=[9], guard=GUARD | {"min_history": 2})


def test_a_second_rollback_to_the_same_checkpoint_never_reads_the_data_of_the_first(
    tmp_path: Path,
) -> None:
    # Example 41 is in step 11 of the data; after the first rollback (data of steps 5..8
    # skipped) it is in step 7 again, so the second spike rolls back to step 4 again, and the
    # run goes on with the data of step 13.
    status, spiked, rollbacks = train(
        tmp_path, "spiked", dataset_size=96, poison_indices=[25, 41], guard=GUARD | {"margin": 0}
    )
    assert (status, rollbacks) == (0, [(7, 4), (7, 4)])
    _, clean, _ = train(tmp_path, "clean", dataset_size=96, drop=[16, 48])
    assert_same_weights(spiked, clean)


def test_too_many_rollbacks_stop_the_run_listing_the_spikes_and_keep_the_checkpoints(
    tmp_path: Path,
) -> None:
    guard = GUARD | {"margin": 0, "max_rollbacks": 1}
    with pytest.raises(LossSpikeError) as raised:
        train(tmp_path, "run", dataset_size=96, poison_indices=[25, 41], guard=guard)
    assert str(raised.value) == (
        "Loss spike at step 7 (loss 47.59 against a running median of 0.5937) after 1 rollbacks "
        "within 1000 steps (max_rollbacks is 1): step 7 (loss 130 against a median of 1.232, "
        "rolled back to step 4). The training stopped; every checkpoint is kept. Lower the "
        "learning rate, check the data of these steps, or raise max_rollbacks."
    )
    # Both spikes were found before the checkpoint of step 8; nothing was deleted.
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")] == ["step_4"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": 0}, "window must be greater than zero, but is 0 instead."),
        ({"margin": -1}, "margin must be 0 or more, but is -1 instead."),
        ({"lookback": -1}, "lookback must be 0 or more, but is -1 instead."),
        ({"cool_lr_factor": 0.0}, r"cool_lr_factor must be in \(0, 1\], but is 0.0 instead."),
        ({"min_history": 9, "window": 8}, r"min_history \(9\) must not exceed window \(8\)"),
        ({"factor": None}, "factor and num_deviations are both None"),
    ],
)
def test_bad_guard_options_are_clear_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossSpikeGuard(**options)


def test_the_guard_needs_a_checkpoint_schedule(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_every_n_steps must be set too"):
        make_trainer(Gangs.single(), tmp_path, {"guard": GUARD, "checkpoint_every": None})


@pytest.mark.slow
@pytest.mark.distributed
def test_a_spike_on_one_rank_rolls_back_both_ranks_as_a_run_without_its_data(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    # Two ranks of 4 examples a step: step 7 reads examples 48..55, the odd ones on rank 1;
    # steps 5..8 read examples 32..63.
    runs = {
        "spiked": {"dataset_size": 128, "poison_indices": [51], "guard": GUARD},
        "clean": {"dataset_size": 128, "drop": [32, 64], "guard": GUARD},
    }
    assert_ok(run_torchrun(2, WORKER, str(tmp_path), json.dumps(runs)))
    for rank in range(2):
        status, rollbacks = json.loads((tmp_path / "spiked" / f"rollbacks_{rank}.json").read_text())
        assert (status, rollbacks) == (0, [[7, 4]])
    spiked = torch.load(tmp_path / "spiked" / "params.pt", weights_only=True)
    clean = torch.load(tmp_path / "clean" / "params.pt", weights_only=True)
    assert_same_weights(spiked, clean)
