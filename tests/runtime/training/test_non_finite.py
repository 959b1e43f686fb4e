"""Non-finite losses and gradients: stop by default, skip on request, agree across ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import NonFiniteError, TrainerError
from tests.conftest import (
    RunTorch,
    make_toy_trainer,
    public_torch_path_in_test_all,
    read_jsonl,
)
from tests.workers.train_toy import PoisonedToyUnit, ToyModel

WORKER = "tests/workers/train_toy.py"


def checkpoint_steps(output_dir: Path) -> list[int]:
    return sorted(
        int(p.name.removeprefix("step_")) for p in (output_dir / "checkpoints").glob("step_*")
    )


def test_a_nan_loss_stops_the_run_before_any_checkpoint_of_it(tmp_path: Path) -> None:
    unit = PoisonedToyUnit(ToyModel(), poison=math.nan, steps=[5], rank=0, my_rank=0)
    trainer = make_toy_trainer(
        tmp_path,
        unit=unit,
        max_num_steps=8,
        checkpoint_every_n_steps=2,
        publish_metrics_every_n_steps=4,
    )
    with pytest.raises(
        NonFiniteError, match=r"The loss was not finite at step 5 on rank 0 \(nan_policy='error'\)"
    ):
        trainer.run()
    # Found at the checkpoint of step 6, which was not saved.
    assert checkpoint_steps(tmp_path) == [2, 4]


@pytest.mark.usefixtures("torch_private_apis")
def test_nan_gradients_name_the_unchecked_steps_and_the_loss_they_poisoned(
    tmp_path: Path,
) -> None:
    unit = PoisonedToyUnit(
        ToyModel(), poison=1.0, steps=[5], rank=0, my_rank=0, gradients_only=True
    )
    trainer = make_toy_trainer(
        tmp_path, unit=unit, max_num_steps=8, publish_metrics_every_n_steps=4
    )
    # Step 5's loss is finite and its gradients are not; the weights they make give step 6 a
    # NaN loss. The check at step 8 knows the loss's step, and that a gradient since step 5 was
    # not finite.
    with pytest.raises(
        NonFiniteError,
        match=r"The loss was not finite at step 6 on rank 0, and a gradient at a step from 5 to "
        r"6 on rank 0 \(nan_policy='error'\)",
    ):
        trainer.run()
    assert checkpoint_steps(tmp_path) == []


@pytest.mark.usefixtures("torch_private_apis")
def test_skip_leaves_the_weights_of_a_non_finite_step_and_counts_it(tmp_path: Path) -> None:
    unit = PoisonedToyUnit(ToyModel(), poison=math.inf, steps=[3], rank=0, my_rank=0)
    model = unit.model
    snapshots: dict[int, list[torch.Tensor]] = {}

    from runtime import TrainerCallback

    class Snap(TrainerCallback):
        def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
            snapshots[step_nr] = [p.detach().clone() for p in model.parameters()]

    trainer = make_toy_trainer(
        tmp_path,
        unit=unit,
        max_num_steps=5,
        nan_policy="skip",
        publish_metrics_every_n_steps=5,
        metrics_dir=tmp_path / "metrics",
        callbacks=[Snap()],
    )
    assert trainer.run() == 0
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4], strict=True))
    (record,) = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert record["num_skipped_steps"] == 1
    assert math.isfinite(record["toy_loss"])  # the skipped step's metric update was rolled back


def test_skip_stops_after_too_many_skips_in_a_row(tmp_path: Path) -> None:
    unit = PoisonedToyUnit(ToyModel(), poison=math.nan, steps=[2, 3, 4], rank=0, my_rank=0)
    trainer = make_toy_trainer(
        tmp_path, unit=unit, max_num_steps=6, nan_policy="skip", max_consecutive_skipped_steps=2
    )
    with pytest.raises(
        NonFiniteError, match="loss was not finite at step 4 on this rank, the 3th step in a row"
    ):
        trainer.run()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"nan_policy": "ignore"},
            "nan_policy must be 'error' or 'skip', but is 'ignore' instead.",
        ),
        (
            {"max_consecutive_skipped_steps": 0},
            "max_consecutive_skipped_steps must be greater than zero, but is 0 instead.",
        ),
        (
            {"gc_every_n_steps": -1},
            "gc_every_n_steps must be greater than zero, but is -1 instead.",
        ),
        ({"flops_per_target": 6e6}, "mfu needs both flops_per_target and device_peak_flops"),
    ],
)
def test_bad_guard_arguments_are_clear_errors(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        make_toy_trainer(tmp_path, **kwargs)


def train(run_torchrun: RunTorch, out: Path, nproc: int, **options: Any) -> Any:
    return run_torchrun(nproc, WORKER, str(out), json.dumps(options))


@pytest.mark.distributed
def test_two_ranks_stop_on_a_nan_of_one_rank_naming_step_and_rank(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    result = train(
        run_torchrun,
        tmp_path,
        2,
        batch_size=4,
        max_num_steps=8,
        checkpoint_every=2,
        publish_every=4,
        poison=math.nan,
        poison_steps=[3],
        poison_rank=1,
    )
    assert result.returncode != 0
    assert "The loss was not finite at step 3 on rank 1 (nan_policy='error')" in result.stderr
    # Found at the publish of step 4, before its checkpoint.
    assert checkpoint_steps(tmp_path) == [2]


@pytest.mark.distributed
@public_torch_path_in_test_all
def test_fsdp_ranks_stop_on_nan_gradients_of_a_finite_loss(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    # Each rank flags its own shards of the reduced gradients; one all-reduce at the check
    # agrees on the lowest rank flagged. Checks at steps 2 (checkpoint) and 3 (publish).
    result = train(
        run_torchrun,
        tmp_path,
        2,
        kind="fsdp",
        batch_size=4,
        max_num_steps=8,
        checkpoint_every=2,
        publish_every=3,
        poison=1.0,
        poison_gradients_only=True,
        poison_steps=[3],
        poison_rank=1,
    )
    assert result.returncode != 0
    assert "The gradients were not finite at step 3 on rank 0 (nan_policy='error')" in (
        result.stderr
    )
    assert checkpoint_steps(tmp_path) == [2]


FP16_LAYOUTS = {"ddp": ("ddp", 1), "fsdp": ("fsdp", 1), "tp": ("fsdp", 2)}

# The two-process runs that end well, run in the shared two-rank launch: name to options.
GOOD_RUNS: dict[str, dict[str, Any]] = {
    "skip": {
        "batch_size": 4,
        "max_num_steps": 6,
        "publish_every": 6,
        "poison": math.nan,
        "poison_steps": [3],
        "poison_rank": 1,
        "nan_policy": "skip",
        "snapshots": True,
    },
    **{
        f"fp16-{layout}-{path}": {
            "batch_size": 4 if tp_size == 1 else 8,
            "max_num_steps": 5,
            "publish_every": 1,
            "kind": kind,
            "tp_size": tp_size,
            "dtype": "float16",
            "fp16_loss_scale": [128.0, 1.0, 2],
            "poison": math.inf,
            "poison_steps": [2],
            "poison_rank": 1,
            "snapshots": True,
            "torch_path": path,
        }
        for layout, (kind, tp_size) in FP16_LAYOUTS.items()
        for path in ("private", "public")
    },
}


@pytest.fixture(scope="module")
def good_runs(two_rank_checks: Path) -> Path:
    """The output directory of each of :data:`GOOD_RUNS`, under ``OUT/NAME``, run in the shared
    two-rank launch (tests/workers/two_rank_checks.py)."""
    return two_rank_checks / "good_runs"


@pytest.mark.distributed
def test_two_ranks_skip_the_same_steps(good_runs: Path) -> None:
    out = good_runs / "skip"
    snapshots = torch.load(out / "snapshots.pt", weights_only=True)
    for name in snapshots[2]:
        assert torch.equal(snapshots[2][name], snapshots[3][name]), name
    assert any(not torch.equal(snapshots[3][n], snapshots[4][n]) for n in snapshots[3])
    (record,) = read_jsonl(out / "metrics" / "train.jsonl")
    assert record["num_skipped_steps"] == 1


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(FP16_LAYOUTS))
@pytest.mark.parametrize("torch_path", ["private", "public"])
def test_fp16_overflow_on_one_rank_backs_off_on_every_rank_and_grows_again(
    good_runs: Path, layout: str, torch_path: str
) -> None:
    out = good_runs / f"fp16-{layout}-{torch_path}"
    records = read_jsonl(out / "metrics" / "train.jsonl")
    # Halved at the overflow of step 2; doubled after two good steps (growth interval 2).
    assert [r["loss_scale"] for r in records] == [128.0, 64.0, 64.0, 128.0, 128.0]
    snapshots = torch.load(out / "snapshots.pt", weights_only=True)
    for name in snapshots[1]:
        assert torch.equal(snapshots[1][name], snapshots[2][name]), name
    assert any(not torch.equal(snapshots[2][n], snapshots[3][n]) for n in snapshots[2])


class BrokenUnit(PoisonedToyUnit):
    """Returns what ``make`` makes of the real (loss, num_targets) at step 2."""

    def __init__(self, make: Any) -> None:
        super().__init__(ToyModel(), poison=1.0, steps=[], rank=0, my_rank=0)
        self._make = make

    def __call__(self, batch: Any) -> Any:
        loss, num_targets = super().__call__(batch)
        return self._make(loss, num_targets) if self._step_nr == 2 else (loss, num_targets)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda loss, n: loss,
            r"The unit returned tensor\(.*\(Tensor\) at step 2\. A TrainUnit returns",
        ),
        (lambda loss, n: (loss.item(), n), r"returned a loss of .* \(float\) at step 2"),
        (
            lambda loss, n: (loss.repeat(3), n),
            r"loss of shape \(3,\) at step 2; it must be a 0-dim",
        ),
        (lambda loss, n: (loss.detach(), n), "returned a loss without grad at step 2"),
        (
            lambda loss, n: (loss, torch.tensor(n)),
            r"target count of tensor\(.*at step 2; it must be an int",
        ),
        (lambda loss, n: (loss, -1), "returned -1 targets at step 2; a count must be zero or more"),
    ],
    ids=["not_a_tuple", "float_loss", "non_scalar", "no_grad", "tensor_count", "negative_count"],
)
def test_a_unit_that_breaks_the_contract_gets_a_clear_error(
    tmp_path: Path, make: Any, message: str
) -> None:
    trainer = make_toy_trainer(tmp_path, unit=BrokenUnit(make), max_num_steps=3)
    with pytest.raises(TrainerError, match=message):
        trainer.run()


class FickleUnit(PoisonedToyUnit):
    """Returns a target count for the first micro-batch of step 2 and None for the second."""

    def __init__(self) -> None:
        super().__init__(ToyModel(), poison=1.0, steps=[], rank=0, my_rank=0)
        self._calls = 0

    def __call__(self, batch: Any) -> Any:
        loss, num_targets = super().__call__(batch)
        self._calls += 1
        return (loss, None) if self._step_nr == 2 and self._calls % 2 == 0 else (loss, num_targets)


def test_a_unit_that_counts_targets_for_only_some_micro_batches_gets_a_clear_error(
    tmp_path: Path,
) -> None:
    trainer = make_toy_trainer(tmp_path, unit=FickleUnit(), num_accumulate=2, max_num_steps=3)
    with pytest.raises(TrainerError, match=r"for some micro-batches of step 2 and None for others"):
        trainer.run()
